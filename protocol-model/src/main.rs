//! `rdkv-protocol-model`: checks a built-in scenario of one of the crate's models and prints
//! the states explored, the time taken and each property's verdict, with a counterexample for
//! every violated property. `--model index` (the default) checks the index-slot protocol under
//! the old or the new protocol; `--model lease` checks a reader of a node that may be paused
//! under a reader rule; `--model reclaim` checks heap reclamation and the fence of a stopped
//! client under a fence rule; `--model leave-order` checks which copy decides at a whole-cluster start
//! under a decide rule; `--model membership` checks a join or a leave with the key moved and a
//! crash at any step, under a move rule. Exits 0 when every property holds, 1 when one is violated, 2 on a usage
//! error.

#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::{Parser, ValueEnum};
use rdkv_protocol_model::lease::{self, LeaseModel, ReaderRule};
use rdkv_protocol_model::{check, IndexModel, Protocol, Scenario};

/// The model to check.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ModelName {
    /// The index-slot protocol.
    Index,
    /// A reader of a node that may be paused, under the serving lease.
    Lease,
    /// Heap reclamation with announce words and the fence of a stopped client.
    Reclaim,
    /// Which copy decides at a whole-cluster start after nodes stopped one at a time.
    LeaveOrder,
    /// A node joining or a member leaving, the key moved, and a crash at any step.
    Membership,
}

/// Command-line arguments.
#[derive(Debug, Parser)]
#[command(
    name = "rdkv-protocol-model",
    about = "Exhaustively model-check rdkv's index-slot protocol, its serving lease, heap reclamation or which copy decides at a whole-cluster start"
)]
struct Arguments {
    /// The model to check: `index` (the index-slot protocol) or `lease` (a reader of a node
    /// that may be paused). Exit code: 0 when every property holds, 1 when one is violated, 2
    /// on a usage error.
    #[arg(long, value_enum, default_value_t = ModelName::Index)]
    model: ModelName,
    /// The scenario to check (see --list), or `all`.
    #[arg(long, default_value = "all")]
    scenario: String,
    /// Index model: the protocol the clients run: `old` (the client before the fix), `new`
    /// (tentative slots, the default) or `new-draft` (tentative slots with the first draft's
    /// kill rule).
    #[arg(long)]
    protocol: Option<Protocol>,
    /// Lease model: the rule a client decides by: `old` (trust the READ), `lease` (the fix, the
    /// default: word READ last, accept if S < t_post and t_done < E), `lease-inclusive` (S <=
    /// t_post on raw clock readings), `lease-no-since` (only t_done < E) or `lease-before` (word
    /// READ first, only t_done < E).
    #[arg(long)]
    reader: Option<ReaderRule>,
    /// Reclaim model: how the node fences a connection that holds reuse back: `ordered` (as
    /// built, the default), `wait-for-out` (keep the word until the requester is out),
    /// `drain-bounded` (release the word even when the drain gave up on a requester inside a
    /// request), `release-first` (release the word before the ERROR) or `never`. Both kinds of
    /// fabric are checked.
    #[arg(long)]
    fence: Option<rdkv_protocol_model::reclaim::FenceRule>,
    /// Leave-order model: when a final snapshot decides over another: `built` (as built, the
    /// default), `header-epochs` (as first built), `epochs-only`, `newest-wins`,
    /// `no-mutual-check` or `any-decider` (all but the first broken).
    #[arg(long)]
    decide: Option<rdkv_protocol_model::leave_order::DecideRule>,
    /// Membership model: the move's rule: `built` (the default),
    /// `promoted-serves-at-once`, `gated-once-applied`, `serves-until-applied`,
    /// `old-holder-backup`, `unlocked-copy`, `no-wait`, `same-view` or
    /// `same-view-old-holder-backup`.
    #[arg(long)]
    rule: Option<rdkv_protocol_model::membership::MoveRule>,
    /// Reclaim model: check the shm-like fabric without its check after a READ's copy.
    #[arg(long)]
    unchecked_reads: bool,
    /// Index model: override the scenario's number of slots in the bucket (1..=4).
    #[arg(long)]
    slots: Option<usize>,
    /// Lease model: override the clock's last value (the scenarios run it to 4).
    #[arg(long, value_parser = clap::value_parser!(u8).range(1..=12))]
    horizon: Option<u8>,
    /// Override the scenario's retry budget: how many times one operation may restart before
    /// it gives up (and stays pending in the history).
    #[arg(long)]
    retry_budget: Option<u8>,
    /// Checker threads. With one (the default) the search order, and so each counterexample
    /// printed, is the same on every run; with more, the first counterexample found may differ.
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// List the scenarios and exit.
    #[arg(long)]
    list: bool,
}

fn main() -> ExitCode {
    let arguments = Arguments::parse();
    let misplaced = match arguments.model {
        ModelName::Index if arguments.reader.is_some() => Some("--reader"),
        ModelName::Index if arguments.horizon.is_some() => Some("--horizon"),
        ModelName::Lease if arguments.protocol.is_some() => Some("--protocol"),
        ModelName::Lease if arguments.slots.is_some() => Some("--slots"),
        ModelName::Index | ModelName::Lease if arguments.fence.is_some() => Some("--fence"),
        ModelName::Index | ModelName::Lease if arguments.unchecked_reads => {
            Some("--unchecked-reads")
        }
        ModelName::Reclaim if arguments.protocol.is_some() || arguments.reader.is_some() => {
            Some("--protocol and --reader")
        }
        ModelName::LeaveOrder
            if arguments.protocol.is_some()
                || arguments.reader.is_some()
                || arguments.fence.is_some()
                || arguments.unchecked_reads =>
        {
            Some("--protocol, --reader, --fence and --unchecked-reads")
        }
        ModelName::Index | ModelName::Lease | ModelName::Reclaim if arguments.decide.is_some() => {
            Some("--decide")
        }
        ModelName::Membership
            if arguments.protocol.is_some()
                || arguments.reader.is_some()
                || arguments.fence.is_some()
                || arguments.decide.is_some()
                || arguments.unchecked_reads =>
        {
            Some("--protocol, --reader, --fence, --decide and --unchecked-reads")
        }
        ModelName::Index | ModelName::Lease | ModelName::Reclaim | ModelName::LeaveOrder
            if arguments.rule.is_some() =>
        {
            Some("--rule")
        }
        _ => None,
    };
    if let Some(flag) = misplaced {
        let model = match arguments.model {
            ModelName::Index => "index",
            ModelName::Lease => "lease",
            ModelName::Reclaim => "reclaim",
            ModelName::LeaveOrder => "leave-order",
            ModelName::Membership => "membership",
        };
        eprintln!("rdkv-protocol-model: {flag} does not apply to --model {model}");
        return ExitCode::from(2);
    }
    match arguments.model {
        ModelName::Index => run_index(&arguments),
        ModelName::Lease => run_lease(&arguments),
        ModelName::Reclaim => run_reclaim(&arguments),
        ModelName::LeaveOrder => run_leave_order(&arguments),
        ModelName::Membership => run_membership(&arguments),
    }
}

/// Checks the membership scenarios asked for under the move rule asked for.
fn run_membership(arguments: &Arguments) -> ExitCode {
    use rdkv_protocol_model::membership::{self, MembershipModel, MoveRule};
    let rule = arguments.rule.unwrap_or(MoveRule::Built);
    if arguments.list {
        for model in MembershipModel::scenarios(rule) {
            println!(
                "{:<22} {:?}, {} cop{}, {}",
                model.name,
                model.change,
                model.replicas,
                if model.replicas == 1 { "y" } else { "ies" },
                if model.crash {
                    "a crash at any step"
                } else {
                    "no crash"
                }
            );
        }
        return ExitCode::SUCCESS;
    }
    let models = if arguments.scenario == "all" {
        MembershipModel::scenarios(rule)
    } else {
        match MembershipModel::named(&arguments.scenario, rule) {
            Ok(model) => vec![model],
            Err(error) => {
                eprintln!("rdkv-protocol-model: {error}");
                return ExitCode::from(2);
            }
        }
    };
    let mut violated = false;
    for model in models {
        let report = membership::check(model, arguments.threads);
        print!("{report}");
        violated |= !report.all_hold();
    }
    exit_code(violated)
}

/// Checks the leave-order scenarios asked for under the decide rule asked for.
fn run_leave_order(arguments: &Arguments) -> ExitCode {
    use rdkv_protocol_model::leave_order::{self, DecideRule, LeaveOrderModel};
    let rule = arguments.decide.unwrap_or(DecideRule::Built);
    if arguments.list {
        for model in LeaveOrderModel::scenarios(rule) {
            println!(
                "{:<16} {} operations, {} restart(s)",
                model.name, model.operations, model.restarts
            );
        }
        return ExitCode::SUCCESS;
    }
    let models = if arguments.scenario == "all" {
        LeaveOrderModel::scenarios(rule)
    } else {
        match LeaveOrderModel::named(&arguments.scenario, rule) {
            Ok(model) => vec![model],
            Err(error) => {
                eprintln!("rdkv-protocol-model: {error}");
                return ExitCode::from(2);
            }
        }
    };
    let mut violated = false;
    for model in models {
        let report = leave_order::check(model, arguments.threads);
        print!("{report}");
        violated |= !report.all_hold();
    }
    exit_code(violated)
}

/// Checks the reclamation model on both fabrics under the fence rule asked for.
fn run_reclaim(arguments: &Arguments) -> ExitCode {
    use rdkv_protocol_model::reclaim::{self, FenceRule, ReclaimModel};
    let rule = arguments.fence.unwrap_or(FenceRule::Ordered);
    let mut violated = false;
    for model in ReclaimModel::scenarios(rule, arguments.unchecked_reads) {
        let report = reclaim::check(model);
        print!("{report}");
        violated |= !report.all_hold();
    }
    exit_code(violated)
}

/// Checks the index-slot scenarios asked for.
fn run_index(arguments: &Arguments) -> ExitCode {
    if arguments.list {
        for scenario in Scenario::all() {
            println!("{:<18} {}", scenario.name, scenario.summary);
        }
        return ExitCode::SUCCESS;
    }
    let scenarios = if arguments.scenario == "all" {
        Scenario::all()
    } else {
        match Scenario::named(&arguments.scenario) {
            Ok(scenario) => vec![scenario],
            Err(error) => {
                eprintln!("rdkv-protocol-model: {error}");
                return ExitCode::from(2);
            }
        }
    };
    let mut violated = false;
    for (index, mut scenario) in scenarios.into_iter().enumerate() {
        if let Some(slots) = arguments.slots {
            scenario = scenario.with_slot_count(slots);
        }
        if let Some(retry_budget) = arguments.retry_budget {
            scenario = scenario.with_retry_budget(retry_budget);
        }
        let protocol = arguments.protocol.unwrap_or(Protocol::New);
        let model = match IndexModel::new(scenario, protocol) {
            Ok(model) => model,
            Err(error) => {
                eprintln!("rdkv-protocol-model: {error}");
                return ExitCode::from(2);
            }
        };
        if index > 0 {
            println!();
        }
        let report = check(&model, arguments.threads);
        print!("{report}");
        violated |= !report.all_hold();
    }
    exit_code(violated)
}

/// Checks the lease scenarios asked for.
fn run_lease(arguments: &Arguments) -> ExitCode {
    let rule = arguments.reader.unwrap_or(ReaderRule::Lease);
    if arguments.list {
        for model in LeaseModel::scenarios(rule) {
            println!("{:<24} {}", model.name, model.summary);
        }
        return ExitCode::SUCCESS;
    }
    let models = if arguments.scenario == "all" {
        LeaseModel::scenarios(rule)
    } else {
        match LeaseModel::named(&arguments.scenario, rule) {
            Ok(model) => vec![model],
            Err(error) => {
                eprintln!("rdkv-protocol-model: {error}");
                return ExitCode::from(2);
            }
        }
    };
    let mut violated = false;
    for (index, mut model) in models.into_iter().enumerate() {
        if let Some(retry_budget) = arguments.retry_budget {
            model = model.with_retry_budget(retry_budget);
        }
        if let Some(horizon) = arguments.horizon {
            model = model.with_horizon(horizon);
        }
        if index > 0 {
            println!();
        }
        let report = lease::check(&model, arguments.threads);
        print!("{report}");
        violated |= !report.all_hold();
    }
    exit_code(violated)
}

/// 1 when a property was violated, else 0.
fn exit_code(violated: bool) -> ExitCode {
    if violated {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
