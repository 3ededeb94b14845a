//! `rdkv-protocol-model`: checks a built-in scenario under the old or the new index-slot
//! protocol and prints the states explored, the time taken and each property's verdict, with a
//! counterexample for every violated property. Exits 0 when every property holds, 1 when one is
//! violated, 2 on a usage error.

#![forbid(unsafe_code)]

use std::process::ExitCode;

use clap::Parser;
use rdkv_protocol_model::{check, IndexModel, Protocol, Scenario};

/// Command-line arguments.
#[derive(Debug, Parser)]
#[command(
    name = "rdkv-protocol-model",
    about = "Exhaustively model-check rdkv's index-slot protocol"
)]
struct Arguments {
    /// The scenario to check (see --list), or `all`.
    #[arg(long, default_value = "all")]
    scenario: String,
    /// The protocol the clients run: `old` (the client before the fix), `new` (tentative slots) or
    /// `new-draft` (tentative slots with the first draft's kill rule). Exit code: 0 when every
    /// property holds, 1 when one is violated, 2 on a usage error.
    #[arg(long, default_value = "new")]
    protocol: Protocol,
    /// Override the scenario's number of slots in the bucket (1..=4).
    #[arg(long)]
    slots: Option<usize>,
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
        let model = match IndexModel::new(scenario, arguments.protocol) {
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
    if violated {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}
