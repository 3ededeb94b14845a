//! The fix: tentative slots. The steps that differ from the old protocol.
//!
//! [`Protocol::New`] follows `client/src/operations.rs` (`insert_absent`) and `docs/protocol.md`
//! (*Insert (key absent)*):
//!
//! - A put or insert of an absent key CASes a *tentative* word into the first empty slot
//!   ("place"), then re-reads the bucket:
//!   - if another slot holds the key committed, it withdraws ("aborts": CASes its tentative slot
//!     back to empty); an insert reports `exists`, a put starts over (and then replaces that
//!     committed slot in place);
//!   - else it kills every other tentative slot of the key (CAS to empty; they go out together,
//!     one slot per step here, and are judged after the last one). If a kill found that very
//!     block committed by its inserter, it aborts as above. If a kill found anything else (the
//!     slot changed under it), it reads the bucket again and decides again;
//!   - then it commits (CAS tentative → committed); if its slot was killed meanwhile, it starts
//!     over and places again (the same block: the real client reuses the block it wrote).
//! - Readers and every "find the key" step see only committed slots. A mutation that reads two
//!   committed slots of the key (the key moved during its read) starts over.
//! - A delete CASes the one committed slot of the key to empty, or starts over on failure.
//!
//! [`Protocol::NewDraft`] differs in one rule: after a kill that found anything but its block
//! committed, it goes on to commit without reading again.

use crate::bucket::{Block, Slot};
use crate::client::{KillTally, Phase};
use crate::key_value::{Operation, Outcome};
use crate::model::Protocol;
use crate::step::Transition;

/// After the re-read that follows placing a tentative block in slot `mine`.
pub(crate) fn confirm_placement(transition: &mut Transition<'_>, mine: u8) {
    let key = transition.key();
    let committed_elsewhere = transition
        .snapshot_matches(key)
        .iter()
        .any(|&(position, _)| position != usize::from(mine));
    if committed_elsewhere {
        transition.set_phase(Phase::Abort { mine });
    } else {
        kill_or_judge(transition, 0, mine, KillTally::default());
    }
}

/// Kills the next other tentative slot of the key at or after `from`; after the last kill,
/// judges what the kills found.
fn kill_or_judge(transition: &mut Transition<'_>, from: usize, mine: u8, tally: KillTally) {
    let key = transition.key();
    let snapshot = transition.snapshot();
    let next_rival = (from..snapshot.slot_count()).find(|&position| {
        position != usize::from(mine) && snapshot.slot(position).tentative_block_of(key).is_some()
    });
    if let Some(position) = next_rival {
        transition.set_phase(Phase::Kill {
            slot: position as u8,
            mine,
            tally,
        });
    } else if tally.rival_committed {
        transition.set_phase(Phase::Abort { mine });
    } else if tally.slot_changed && transition.model.protocol == Protocol::New {
        transition.retry(
            "a kill found its slot changed",
            Phase::Reread { next: 0, mine },
        );
    } else {
        transition.set_phase(Phase::Commit { mine });
    }
}

/// Kills a rival's tentative slot and notes what the CAS found.
pub(crate) fn kill(transition: &mut Transition<'_>, slot: u8, mine: u8, mut tally: KillTally) {
    let expected = transition.snapshot().slot(usize::from(slot));
    if !transition.compare_and_swap(slot, expected, Slot::Empty) {
        match (expected, transition.last_found()) {
            (Slot::Tentative(block), Some(Slot::Committed(found))) if block == found => {
                tally.rival_committed = true
            }
            _ => tally.slot_changed = true,
        }
    }
    kill_or_judge(transition, usize::from(slot) + 1, mine, tally);
}

/// Withdraws my tentative slot because the key is committed elsewhere.
pub(crate) fn abort(transition: &mut Transition<'_>, mine: u8) {
    let word = Slot::Tentative(transition.written_block());
    // May fail if a rival killed it already: either way it is gone.
    transition.compare_and_swap(mine, word, Slot::Empty);
    match transition.operation {
        Operation::Insert { .. } => transition.complete(Outcome::Exists),
        _ => transition.restart("the key is committed elsewhere"),
    }
}

/// Makes my tentative slot the key's committed slot.
pub(crate) fn commit(transition: &mut Transition<'_>, mine: u8) {
    let block = transition.written_block();
    if transition.compare_and_swap(mine, Slot::Tentative(block), Slot::Committed(block)) {
        transition.complete(Outcome::Applied);
    } else {
        transition.restart("my tentative slot was killed");
    }
}

/// After a delete's read: absent, ambiguous (start over), or clear the one committed slot.
pub(crate) fn start_delete(transition: &mut Transition<'_>, matches: &[(usize, Block)]) {
    match matches {
        [] => transition.complete(Outcome::Deleted { existed: false }),
        [(position, block)] => transition.set_phase(Phase::Replace {
            slot: *position as u8,
            expected: Slot::Committed(*block),
            replacement: Slot::Empty,
            outcome: Outcome::Deleted { existed: true },
        }),
        _ => transition.restart("read two committed slots of the key"),
    }
}
