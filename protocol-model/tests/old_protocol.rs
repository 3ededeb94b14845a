//! The protocol before the fix (`client/src/operations.rs` at commit `07546f6`): the checker finds the duplicate-insert bugs,
//! and the first draft of the fix: the checker finds its kill-rule bug. Each test prints the
//! counterexample it found.

use rdkv_protocol_model::check::Counterexample;
use rdkv_protocol_model::key_value::Outcome;
use rdkv_protocol_model::model::{
    INSERT_EXISTS_NEVER_VISIBLE, LINEARIZABLE, NO_RESURRECTION, ONE_COMMITTED_SLOT_PER_KEY,
};
use rdkv_protocol_model::step::{Access, Effect};
use rdkv_protocol_model::{check, IndexModel, Protocol, Report, Scenario};

/// Checks the built-in scenario `name` under `protocol` and prints the report.
fn run(name: &str, protocol: Protocol) -> Report {
    let scenario = Scenario::named(name).expect("a built-in scenario");
    let model = IndexModel::new(scenario, protocol).expect("a valid scenario");
    let report = check(&model, 1);
    println!("{report}");
    report
}

/// The counterexample for `property`, which must exist.
fn counterexample<'report>(report: &'report Report, property: &str) -> &'report Counterexample {
    report
        .counterexample(property)
        .unwrap_or_else(|| panic!("expected a counterexample for {property:?}:\n{report}"))
}

#[test]
fn a_losing_put_resurrects_an_overwritten_value() {
    let report = run("duplicate-put", Protocol::Old);
    let path = counterexample(&report, NO_RESURRECTION);
    // Only a CAS that swapped changes what is visible: here, the losing put's CAS of its block
    // into the winner's slot, over the newer value.
    let last = path.steps.last().expect("a non-empty path");
    assert!(matches!(
        last.event.access,
        Access::CompareAndSwap { expected, found, .. } if expected == found
    ));
}

#[test]
fn an_insert_reports_exists_after_its_value_was_visible() {
    let report = run("duplicate-insert", Protocol::Old);
    let path = counterexample(&report, INSERT_EXISTS_NEVER_VISIBLE);
    let last = path.steps.last().expect("a non-empty path");
    assert_eq!(last.event.effect, Effect::Returned(Outcome::Exists));
}

#[test]
fn racing_inserts_are_not_linearizable() {
    let report = run("duplicate-insert", Protocol::Old);
    let path = counterexample(&report, LINEARIZABLE);
    // A history turns non-linearizable only when an operation returns (with one checker thread
    // the path found is always the same one: a get that returns the losing insert's value).
    let last = path.steps.last().expect("a non-empty path");
    assert!(matches!(last.event.effect, Effect::Returned(_)));
}

#[test]
fn the_old_protocol_passes_where_no_insert_races_a_freed_lower_slot() {
    // The old protocol's bugs need two inserters that pick different first empty slots; here
    // they cannot, and the checker agrees.
    let report = run("put-then-update", Protocol::Old);
    assert!(report.all_hold(), "{report}");
}

#[test]
fn the_draft_kill_rule_commits_a_key_twice() {
    let report = run("put-then-update", Protocol::NewDraft);
    let path = counterexample(&report, ONE_COMMITTED_SLOT_PER_KEY);
    assert_eq!(
        path.steps.last().expect("a non-empty path").event.effect,
        Effect::Returned(Outcome::Applied)
    );
}
