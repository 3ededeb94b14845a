//! Today's protocol, as `client/src/operations.rs` implements it: the steps that differ from
//! the new one.
//!
//! - A put or insert of an absent key CASes a *committed* word into the first empty slot, then
//!   re-reads the bucket and resolves duplicates by position: if the lowest-position match is
//!   not its own slot, an insert clears its slot and reports `exists`; a put CASes its block
//!   into the winner's slot (re-reading and trying again if that fails) and then clears its own.
//! - A delete CASes every slot holding the key to empty, highest position first and the lowest
//!   (the winner) last, and reports `existed` iff the winner's CAS succeeded (else restarts).
//! - Readers take the match at the lowest position.

use crate::bucket::{Block, Slot};
use crate::client::Phase;
use crate::key_value::{Operation, Outcome};
use crate::step::Transition;

/// After the re-read that follows a successful placement in slot `mine`.
pub(crate) fn resolve_duplicates(transition: &mut Transition<'_>, mine: u8) {
    let matches = transition.snapshot_matches(transition.key());
    match matches.first().copied() {
        // Deleted by someone else after our CAS: our insert happened.
        None => transition.complete(Outcome::Applied),
        Some((position, _)) if position == usize::from(mine) => {
            transition.complete(Outcome::Applied)
        }
        Some((winner, block)) => match transition.operation {
            Operation::Insert { .. } => transition.set_phase(Phase::RemoveDuplicate {
                mine,
                outcome: Outcome::Exists,
            }),
            _ => transition.set_phase(Phase::OverwriteWinner {
                winner: winner as u8,
                expected: Slot::Committed(block),
                mine,
            }),
        },
    }
}

/// A losing put CASes its block into the winner's slot; on failure it re-reads and resolves again.
pub(crate) fn overwrite_winner(
    transition: &mut Transition<'_>,
    winner: u8,
    expected: Slot,
    mine: u8,
) {
    let replacement = Slot::Committed(transition.written_block());
    if transition.compare_and_swap(winner, expected, replacement) {
        transition.set_phase(Phase::RemoveDuplicate {
            mine,
            outcome: Outcome::Applied,
        });
    } else {
        transition.retry(
            "lost the CAS on the winner slot",
            Phase::Reread { next: 0, mine },
        );
    }
}

/// A loser clears its own slot (the CAS may fail; the outcome is reported either way).
pub(crate) fn remove_duplicate(transition: &mut Transition<'_>, mine: u8, outcome: Outcome) {
    let word = Slot::Committed(transition.written_block());
    transition.compare_and_swap(mine, word, Slot::Empty);
    transition.complete(outcome);
}

/// After a delete's read: nothing to do, or start clearing from the highest match.
pub(crate) fn start_delete(transition: &mut Transition<'_>, matches: &[(usize, Block)]) {
    match matches.last() {
        None => transition.complete(Outcome::Deleted { existed: false }),
        Some(&(highest, _)) => transition.set_phase(Phase::ClearForDelete {
            slot: highest as u8,
        }),
    }
}

/// One CAS of a delete's list: the matching `slot` from the word read to empty.
pub(crate) fn clear_for_delete(transition: &mut Transition<'_>, slot: u8) {
    let matches = transition.snapshot_matches(transition.key());
    let expected = transition.snapshot().slot(usize::from(slot));
    let swapped = transition.compare_and_swap(slot, expected, Slot::Empty);
    let winner = matches
        .first()
        .map(|&(position, _)| position)
        .expect("a delete clears only when its read found the key");
    if usize::from(slot) == winner {
        if swapped {
            transition.complete(Outcome::Deleted { existed: true });
        } else {
            transition.restart("lost the CAS on the winner slot");
        }
    } else {
        let next_lower = matches
            .iter()
            .rev()
            .map(|&(position, _)| position)
            .find(|&position| position < usize::from(slot))
            .expect("the winner is below every other match");
        transition.set_phase(Phase::ClearForDelete {
            slot: next_lower as u8,
        });
    }
}
