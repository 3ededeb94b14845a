//! The membership model's unit tests: one quick scenario per rule (the heavy `*-crash`
//! scenarios run in CI through the command line), and that the exploration reaches the steps
//! the move is made of.

use super::*;

fn report(name: &str, rule: MoveRule) -> MembershipReport {
    check(
        MembershipModel::named(name, rule).expect("a built-in scenario"),
        1,
    )
}

#[test]
fn the_built_leave_holds_with_one_copy() {
    let found = report("leave-one-copy", MoveRule::Built);
    assert!(found.all_hold(), "{found}");
    assert!(found.unique_states > 100_000, "{found}");
}

/// The removed node served until it applied its removal: a client still routing by the older
/// view read it after a write acknowledged under the new one.
#[test]
fn a_removed_node_that_serves_until_it_applies_its_removal_gives_a_stale_read() {
    let found = report("leave-one-copy", MoveRule::ServesUntilApplied);
    assert_eq!(found.violated(), vec![LINEARIZABLE], "{found}");
}

/// With two copies, the view after `Promote` makes the old primary a backup: a writer of that
/// view CASes it before its commit, and a reader still routing by the older view reads it
/// there, before a reader of the new view reads the lock on the new primary.
#[test]
fn a_promoted_node_that_serves_at_once_shows_a_write_before_its_commit() {
    let found = report("join", MoveRule::PromotedServesAtOnce);
    assert_eq!(found.violated(), vec![LINEARIZABLE], "{found}");
    let old_holder = report("join", MoveRule::OldHolderBackup);
    assert_eq!(old_holder.violated(), vec![LINEARIZABLE], "{old_holder}");
}

/// A client that uses a node only at its operation's own view closes it.
#[test]
fn using_nodes_only_at_the_operations_view_makes_the_join_hold() {
    let found = report("join", MoveRule::SameView);
    assert!(found.all_hold(), "{found}");
}

/// With one copy, the old holder serves until it applies `Promote`; a write of the new view
/// reaches the new holder alone.
#[test]
fn a_promoted_node_that_serves_at_once_gives_a_stale_read_with_one_copy() {
    let found = report("join-one-copy", MoveRule::PromotedServesAtOnce);
    assert_eq!(found.violated(), vec![LINEARIZABLE], "{found}");
}

/// Gated only once it applied its promotion, the promoted node serves as a joining node before
/// that, and a client that learned the promotion from another member commits on it while the
/// old holder still serves the older view.
#[test]
fn a_promotion_gated_once_applied_leaves_a_stale_read_before_the_node_applies_it() {
    let found = report("join-one-copy", MoveRule::GatedOnceApplied);
    assert_eq!(found.violated(), vec![LINEARIZABLE], "{found}");
    let path = found.counterexample(LINEARIZABLE).expect("violated");
    let steps = found.violating_prefix(LINEARIZABLE, path);
    let promoted = steps
        .iter()
        .position(|action| *action == MembershipAction::Finish)
        .expect("the promotion is committed");
    let moving = MOVING as u8;
    assert!(
        !steps[promoted..].contains(&MembershipAction::Apply(moving)),
        "{found}"
    );
}

/// As built, a joining node serves nothing from its promotion request until every member
/// applied the promotion: the join holds with one copy and with two.
#[test]
fn the_built_join_holds_with_one_copy_and_two() {
    let found = report("join-one-copy", MoveRule::Built);
    assert!(found.all_hold(), "{found}");
    let two = report("join", MoveRule::Built);
    assert!(two.all_hold(), "{two}");
}

#[test]
fn move_rule_names_round_trip() {
    for rule in MoveRule::ALL {
        assert_eq!(rule.to_string().parse::<MoveRule>(), Ok(rule));
    }
    assert!("sometimes".parse::<MoveRule>().is_err());
}

/// Whether a state that `condition` holds in is reachable from `start` within `limit` states.
fn reaches(
    model: &MembershipModel,
    start: MembershipState,
    limit: usize,
    condition: impl Fn(&MembershipState) -> bool,
) -> bool {
    let mut pending = std::collections::VecDeque::from([start]);
    let mut seen = std::collections::HashSet::new();
    while let Some(state) = pending.pop_front() {
        if condition(&state) {
            return true;
        }
        if seen.len() > limit || !seen.insert(state.clone()) {
            continue;
        }
        let mut actions = Vec::new();
        model.actions(&state, &mut actions);
        pending.extend(
            actions
                .into_iter()
                .filter_map(|action| model.next_state(&state, action)),
        );
    }
    false
}

/// Reachability: a lock holder reading a backup again (after a fence), the move finished, and,
/// once the joining node crashed holding its refill's lock, a writer taking that lock over.
#[test]
fn the_exploration_reaches_a_resume_the_end_of_the_move_and_a_steal() {
    let model = MembershipModel::named("join-one-copy-crash", MoveRule::Built).expect("built-in");
    let resumed = |state: &MembershipState| {
        state
            .clients
            .iter()
            .any(|client| client.lock.is_some() && matches!(client.stage, Stage::Reread(_)))
    };
    assert!(reaches(&model, model.initial(), 300_000, resumed));
    let finished = |state: &MembershipState| state.copier.stage == CopierStage::Done;
    assert!(reaches(&model, model.initial(), 300_000, finished));
    // The refill locks the key's holder, and its node crashes.
    let mut state = model.initial();
    let copier = model.copier_client() as u8;
    for action in [
        MembershipAction::Begin,
        MembershipAction::Apply(0),
        MembershipAction::Apply(1),
        MembershipAction::Apply(2),
        MembershipAction::Copier,
        MembershipAction::Copier,
        MembershipAction::Copier,
        MembershipAction::Step(copier),
        MembershipAction::Step(copier),
        MembershipAction::Step(copier),
        MembershipAction::Crash(0),
    ] {
        let mut enabled = Vec::new();
        model.actions(&state, &mut enabled);
        assert!(enabled.contains(&action), "{action:?} in {state}");
        state = model.next_state(&state, action).expect("a step");
    }
    assert!(state.nodes[1].word.locked, "{state}");
    let stole = |state: &MembershipState| {
        state
            .clients
            .iter()
            .any(|client| matches!(client.stage, Stage::Steal(_)))
    };
    assert!(reaches(&model, state, 100_000, stole));
}
