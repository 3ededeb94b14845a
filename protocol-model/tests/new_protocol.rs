//! The new (tentative-slot) protocol: every property holds in every reachable state of every
//! built-in scenario. Each test also asserts a floor on the number of distinct states explored,
//! so a change that quietly prunes the search (a scenario made trivial, a step merged away)
//! fails instead of passing vacuously.

use rdkv_protocol_model::key_value::Operation;
use rdkv_protocol_model::{check, IndexModel, Protocol, Scenario};

/// Checks `scenario` exhaustively under the new protocol and asserts the outcome.
fn every_property_holds(name: &str, minimum_states: usize) {
    let scenario = Scenario::named(name).expect("a built-in scenario");
    let model = IndexModel::new(scenario, Protocol::New).expect("a valid scenario");
    let report = check(&model, 1);
    println!("{report}");
    assert!(report.all_hold(), "{report}");
    assert!(report.is_exhaustive());
    assert!(
        report.unique_states >= minimum_states,
        "{name}: only {} states explored (expected at least {minimum_states})",
        report.unique_states
    );
}

#[test]
fn duplicate_put() {
    every_property_holds("duplicate-put", 2_500);
}

#[test]
fn duplicate_insert() {
    every_property_holds("duplicate-insert", 60_000);
}

#[test]
fn slot_reuse() {
    every_property_holds("slot-reuse", 300_000);
}

#[test]
fn every_operation() {
    every_property_holds("every-operation", 250_000);
}

#[test]
fn put_then_update() {
    every_property_holds("put-then-update", 6_000);
}

#[test]
fn three_puts() {
    every_property_holds("three-puts", 1_000_000);
}

#[test]
fn the_scenarios_use_every_operation_and_reuse_freed_slots() {
    let scenarios = Scenario::all();
    let operations: Vec<Operation> = scenarios
        .iter()
        .flat_map(|scenario| scenario.scripts.iter().flatten().copied())
        .collect();
    let kinds: [fn(&Operation) -> bool; 6] = [
        |operation| matches!(operation, Operation::Get { .. }),
        |operation| matches!(operation, Operation::Put { .. }),
        |operation| matches!(operation, Operation::Insert { .. }),
        |operation| matches!(operation, Operation::Update { .. }),
        |operation| matches!(operation, Operation::Delete { .. }),
        |operation| matches!(operation, Operation::CompareAndSwap { .. }),
    ];
    for kind in kinds {
        assert!(operations.iter().any(kind));
    }
    // Slot reuse: some client deletes a key and later writes it again.
    let reuses = scenarios
        .iter()
        .flat_map(|scenario| &scenario.scripts)
        .any(|script| {
            script.iter().enumerate().any(|(index, operation)| {
                matches!(operation, Operation::Delete { .. })
                    && script[index + 1..].iter().any(|later| {
                        later.key() == operation.key() && later.written_value().is_some()
                    })
            })
        });
    assert!(reuses);
}
