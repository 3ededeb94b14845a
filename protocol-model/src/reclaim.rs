//! An exhaustive model check of heap reclamation with announce words and the fence of a
//! connection that holds reuse back (`docs/protocol.md`, *Heap space*): may an extent be
//! reused while a stopped client can still read it and trust what it read, or write into it?
//!
//! # The model
//!
//! One key, one slot. Extent `X` holds block `A`, which the slot references; block `B` lies in
//! an extent never reused. Client R (the one that stops) owns grant `G`, an extent it may
//! still write into. Each step is atomic, and any step may come between any two of another
//! role's: a client stopped for any time between two of its steps is one of the interleavings.
//!
//! - **R runs one operation of four requests, in order on its queue pair:** the announce
//!   (`started = 1`), a WRITE into `G` (a block it places), a READ of the slot, a READ of the
//!   block the slot names; the operation then returns the block it read (it trusts it), and a
//!   last request announces it finished (`quiescent = 1`). A request fails if R's queue pair is in ERROR;
//!   the operation then fails and returns nothing.
//! - **How a request runs** ([`Fabric`]): on `soft` and `verbs` the responder checks and
//!   executes it in one step (the NIC); on `shm` the requester runs it itself, in two steps:
//!   it *enters* (checks that the queue pair receives) and then *acts* on the memory, and a
//!   READ's data counts only if the queue pair still receives after the copy (as built;
//!   `RequesterRunsUnchecked` leaves that check out).
//! - **Client W** replaces the slot's `A` with `B`, once.
//! - **The collector** *scans* (the slot no longer names `X`), then *snapshots* R's announced
//!   `started` (nothing if R's word is released), making `X` a candidate; *frees* `X` once R's
//!   word is released or `quiescent` reaches the snapshot; and a later writer *reuses* `X`
//!   (it then holds another block, `C`). `G` is freed once R's word is released (the grant is
//!   sealed with its connection gone) and may then be reused likewise.
//! - **The fence** ([`FenceRule`]) of R's connection may start at any moment: the model does
//!   not say when the node decides that R is silent, so every bound (`heap_hold_limit`, the
//!   lease) is covered.
//!
//! The properties: [`NO_REUSED_READ`], R never returns `C`; [`NO_WRITE_INTO_REUSED`], R's
//! WRITE never lands in `G` after `G` was reused.
//!
//! # What the checker finds
//!
//! - [`FenceRule::Ordered`], as built (`server/src/session/teardown.rs`): the queue pair to
//!   ERROR, the drain (which may give up on a requester stopped inside a request), then R's
//!   word released if its requester is out (`QueuePair::requester_out`); if it is not, the
//!   word is no longer waited for by snapshots (`Announcements::fence_reads`) but is kept,
//!   with the grant, until it is out. Holds where the responder runs requests and where the
//!   requester runs them and checks each READ after its copy; without that check, R returns
//!   `C`.
//! - [`FenceRule::WaitForOut`] (keep everything until the requester is out) holds everywhere,
//!   but a client stopped inside a request then holds every snapshot.
//! - [`FenceRule::DrainBounded`] (release everything once the drain gave up): R's WRITE lands
//!   in the reused `G`; without the READ check, R also returns `C`.
//! - [`FenceRule::ReleaseFirst`] (the word released before the ERROR): both fail everywhere.
//! - [`FenceRule::Never`], no early fence (reclamation waits for R's word): holds.
//!
//! # What the model leaves out
//!
//! The quarantine (every step also completes after 1.25 × the operation deadline, a bound
//! that trusts the client's deadline, which a stopped `shm` requester does not keep), more
//! operations, several extents, the compactor, and sealed grants of earlier allocations (they
//! wait for R's word as `G` does).

use std::fmt;

use stateright::{Checker, Model, Property};

/// Property: a client never returns a block read from an extent reused under it.
pub const NO_REUSED_READ: &str = "no operation returns a block read from a reused extent";
/// Property: a client's WRITE never lands in an extent after its reuse.
pub const NO_WRITE_INTO_REUSED: &str = "no WRITE lands in a reused extent";

/// Who runs a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fabric {
    /// The responder checks and executes each request in one step (`soft`, `verbs`).
    ResponderRuns,
    /// The requester checks, then executes, each request itself, and trusts a READ only if
    /// the queue pair still receives after its copy (`shm` as built).
    RequesterRuns,
    /// As `RequesterRuns`, without the check after a READ's copy.
    RequesterRunsUnchecked,
}

impl Fabric {
    /// Every fabric.
    pub const ALL: [Fabric; 3] = [
        Fabric::ResponderRuns,
        Fabric::RequesterRuns,
        Fabric::RequesterRunsUnchecked,
    ];
}

/// How the node fences a connection that holds reuse back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FenceRule {
    /// As built: ERROR, a drain that may give up while the requester is inside a request; then
    /// the word released if it is out, else the word no longer waited for by snapshots but
    /// kept, with the grant, until it is out.
    Ordered,
    /// ERROR, a drain that waits until the requester is out, then the word released.
    WaitForOut,
    /// ERROR, a drain that may give up while the requester is inside, then the word released.
    DrainBounded,
    /// The word released, then ERROR.
    ReleaseFirst,
    /// No early fence.
    Never,
}

impl FenceRule {
    /// Every rule, the built one first.
    pub const ALL: [FenceRule; 5] = [
        FenceRule::Ordered,
        FenceRule::WaitForOut,
        FenceRule::DrainBounded,
        FenceRule::ReleaseFirst,
        FenceRule::Never,
    ];
}

impl fmt::Display for FenceRule {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(match self {
            FenceRule::Ordered => "ordered",
            FenceRule::WaitForOut => "wait-for-out",
            FenceRule::DrainBounded => "drain-bounded",
            FenceRule::ReleaseFirst => "release-first",
            FenceRule::Never => "never",
        })
    }
}

impl std::str::FromStr for FenceRule {
    type Err = String;

    fn from_str(name: &str) -> std::result::Result<Self, Self::Err> {
        FenceRule::ALL
            .into_iter()
            .find(|rule| rule.to_string() == name)
            .ok_or_else(|| {
                format!(
                    "unknown fence rule `{name}`: ordered, drain-bounded, release-first or never"
                )
            })
    }
}

/// A block: what an extent holds or the slot names.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Block {
    /// The block in `X` the slot names at first.
    A,
    /// The block that replaces it (in an extent never reused).
    B,
    /// Another writer's block in `X` after its reuse.
    C,
}

/// An extent's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Extent {
    /// Referenced (`X`) or owned (`G`).
    InUse,
    /// Unreferenced at a scan whose snapshot is pending.
    Scanned,
    /// A candidate: free once R's word is released or quiescent through this snapshot
    /// (`None`: R had no word at the snapshot).
    Candidate(Option<u8>),
    /// Free.
    Free,
    /// Reused by another writer.
    Reused,
}

/// R's requests, in order.
const REQUESTS: [Request; 5] = [
    Request::Announce,
    Request::WriteGrant,
    Request::ReadSlot,
    Request::ReadBlock,
    Request::AnnounceDone,
];

/// One request of R's operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Request {
    /// WRITE of the word: `started = 1`.
    Announce,
    /// READ of the slot.
    ReadSlot,
    /// READ of the block the slot named.
    ReadBlock,
    /// WRITE into R's grant.
    WriteGrant,
    /// WRITE of the word: `quiescent = 1` (after the operation returned).
    AnnounceDone,
}

/// The fence's progress.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum FenceStage {
    /// Not started.
    None,
    /// The queue pair is in ERROR.
    Errored,
    /// Drained (the rule says when).
    Drained,
    /// Drained with the requester still inside a request: the word kept, but no longer
    /// waited for by snapshots; the grant kept (`Ordered`).
    ReadsFenced,
    /// The word released first (`ReleaseFirst`), the queue pair still receiving.
    ReleasedFirst,
    /// Done: the queue pair in ERROR and the word released.
    Done,
}

/// One state.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ReclaimState {
    /// What the slot names.
    pub slot: Block,
    /// Extent `X` (holds `A` until reused, then `C`).
    pub extent: Extent,
    /// R's grant `G`.
    pub grant: Extent,
    /// R's word: `started`, `quiescent`, and whether it is still R's (not released).
    pub word: (u8, u8, bool),
    /// Whether snapshots no longer wait for R's word (its reads fenced).
    pub reads_fenced: bool,
    /// Whether R's queue pair receives.
    pub receiving: bool,
    /// R's next request (an index into its list; past the end: done).
    pub next_request: u8,
    /// On `shm`: R entered its next request and has not acted yet.
    pub inside: bool,
    /// Whether R's operation failed.
    pub failed: bool,
    /// What R's slot READ found.
    pub slot_read: Option<Block>,
    /// What R's block READ found.
    pub block_read: Option<Block>,
    /// What R's operation returned.
    pub returned: Option<Block>,
    /// Whether R's WRITE landed in `G` after `G` was reused.
    pub wrote_into_reused: bool,
    /// The fence's progress.
    pub fence: FenceStage,
}

/// One step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReclaimAction {
    /// R's next request: executed (responder runs), or entered (requester runs).
    Request,
    /// R acts on the request it entered (requester runs).
    Act,
    /// R's operation returns what it read.
    Return,
    /// W replaces `A` with `B`.
    Replace,
    /// The collector's scan finds `X` unreferenced.
    Scan,
    /// The collector snapshots R's word.
    Snapshot,
    /// The collector frees `X`.
    Free,
    /// Another writer reuses `X`.
    Reuse,
    /// `G`, its connection gone, is freed.
    FreeGrant,
    /// Another writer reuses `G`.
    ReuseGrant,
    /// The fence's next step.
    Fence,
}

/// The model: a fabric and a fence rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ReclaimModel {
    /// Who runs requests.
    pub fabric: Fabric,
    /// How the node fences R.
    pub rule: FenceRule,
}

impl ReclaimModel {
    /// Both kinds of fabric as built under `rule` (with `unchecked_reads`, the requester-run
    /// one without its check after a READ).
    pub fn scenarios(rule: FenceRule, unchecked_reads: bool) -> Vec<ReclaimModel> {
        let requester = if unchecked_reads {
            Fabric::RequesterRunsUnchecked
        } else {
            Fabric::RequesterRuns
        };
        [Fabric::ResponderRuns, requester]
            .into_iter()
            .map(|fabric| ReclaimModel { fabric, rule })
            .collect()
    }

    fn initial() -> ReclaimState {
        ReclaimState {
            slot: Block::A,
            extent: Extent::InUse,
            grant: Extent::InUse,
            word: (0, 0, true),
            reads_fenced: false,
            receiving: true,
            next_request: 0,
            inside: false,
            failed: false,
            slot_read: None,
            block_read: None,
            returned: None,
            wrote_into_reused: false,
            fence: FenceStage::None,
        }
    }

    /// R's request about to run, if any is left and its operation has not failed.
    fn pending_request(state: &ReclaimState) -> Option<Request> {
        let request = REQUESTS.get(usize::from(state.next_request)).copied()?;
        let returned_first =
            request == Request::AnnounceDone && state.returned.is_none() && !state.failed;
        (!state.failed && !returned_first).then_some(request)
    }

    /// The effect of R's `request` on the memory; where the requester runs it and checks its
    /// READs, a READ that finds the queue pair no longer receiving after its copy fails.
    fn act(&self, state: &mut ReclaimState, request: Request) {
        match request {
            Request::Announce if state.word.2 => state.word.0 = 1,
            Request::AnnounceDone if state.word.2 => state.word.1 = 1,
            Request::ReadSlot => state.slot_read = Some(state.slot),
            Request::ReadBlock => {
                state.block_read = match state.slot_read {
                    Some(Block::A) if state.extent == Extent::Reused => Some(Block::C),
                    other => other,
                }
            }
            Request::WriteGrant => state.wrote_into_reused |= state.grant == Extent::Reused,
            Request::Announce | Request::AnnounceDone => {}
        }
        let read = matches!(request, Request::ReadSlot | Request::ReadBlock);
        if read && self.fabric == Fabric::RequesterRuns && !state.receiving {
            state.failed = true;
            state.next_request = REQUESTS.len() as u8;
            return;
        }
        state.next_request += 1;
    }

    /// R's next request: it fails on a queue pair in ERROR, else runs (or is entered).
    fn request(&self, state: &mut ReclaimState, request: Request) {
        if !state.receiving {
            state.failed = request != Request::AnnounceDone || state.returned.is_none();
            state.next_request = REQUESTS.len() as u8;
            return;
        }
        match self.fabric {
            Fabric::ResponderRuns => self.act(state, request),
            Fabric::RequesterRuns | Fabric::RequesterRunsUnchecked => state.inside = true,
        }
    }

    /// Whether R's word no longer holds `X` as a candidate of `snapshot`.
    fn word_done(state: &ReclaimState, snapshot: Option<u8>) -> bool {
        let (_, quiescent, live) = state.word;
        !live || state.reads_fenced || snapshot.is_none_or(|started| quiescent >= started)
    }

    fn fence_enabled(&self, state: &ReclaimState) -> bool {
        match (self.rule, state.fence) {
            (FenceRule::Never, _) | (_, FenceStage::Done) => false,
            (FenceRule::WaitForOut, FenceStage::Errored) => !state.inside,
            (FenceRule::Ordered, FenceStage::ReadsFenced) => !state.inside,
            _ => true,
        }
    }

    fn fence(&self, state: &mut ReclaimState) {
        state.fence = match (self.rule, state.fence) {
            (FenceRule::ReleaseFirst, FenceStage::None) => {
                state.word.2 = false;
                FenceStage::ReleasedFirst
            }
            (FenceRule::ReleaseFirst, _) => {
                state.receiving = false;
                FenceStage::Done
            }
            (_, FenceStage::None) => {
                state.receiving = false;
                FenceStage::Errored
            }
            (_, FenceStage::Errored) => FenceStage::Drained,
            (FenceRule::Ordered, FenceStage::Drained) if state.inside => {
                state.reads_fenced = true;
                FenceStage::ReadsFenced
            }
            (_, _) => {
                state.word.2 = false;
                FenceStage::Done
            }
        };
    }

    fn collector_actions(state: &ReclaimState, actions: &mut Vec<ReclaimAction>) {
        match state.extent {
            Extent::InUse if state.slot != Block::A => actions.push(ReclaimAction::Scan),
            Extent::Scanned => actions.push(ReclaimAction::Snapshot),
            Extent::Candidate(snapshot) if Self::word_done(state, snapshot) => {
                actions.push(ReclaimAction::Free)
            }
            Extent::Free => actions.push(ReclaimAction::Reuse),
            _ => {}
        }
        match state.grant {
            Extent::InUse if !state.word.2 => actions.push(ReclaimAction::FreeGrant),
            Extent::Free => actions.push(ReclaimAction::ReuseGrant),
            _ => {}
        }
    }

    /// Whether `property` holds in `state`.
    pub fn holds(property: &str, state: &ReclaimState) -> bool {
        match property {
            NO_REUSED_READ => state.returned != Some(Block::C),
            NO_WRITE_INTO_REUSED => !state.wrote_into_reused,
            _ => true,
        }
    }
}

impl Model for ReclaimModel {
    type State = ReclaimState;
    type Action = ReclaimAction;

    fn init_states(&self) -> Vec<ReclaimState> {
        vec![Self::initial()]
    }

    fn actions(&self, state: &ReclaimState, actions: &mut Vec<ReclaimAction>) {
        if state.inside {
            actions.push(ReclaimAction::Act);
        } else if Self::pending_request(state).is_some() {
            actions.push(ReclaimAction::Request);
        } else if state.returned.is_none()
            && !state.failed
            && usize::from(state.next_request) == REQUESTS.len() - 1
        {
            actions.push(ReclaimAction::Return);
        }
        if state.slot == Block::A {
            actions.push(ReclaimAction::Replace);
        }
        Self::collector_actions(state, actions);
        if self.fence_enabled(state) {
            actions.push(ReclaimAction::Fence);
        }
    }

    fn next_state(&self, state: &ReclaimState, action: ReclaimAction) -> Option<ReclaimState> {
        let mut next = state.clone();
        match action {
            ReclaimAction::Request => {
                let request = Self::pending_request(state)?;
                self.request(&mut next, request);
            }
            ReclaimAction::Act => {
                let request = REQUESTS.get(usize::from(state.next_request)).copied()?;
                next.inside = false;
                self.act(&mut next, request);
            }
            ReclaimAction::Return => next.returned = next.block_read,
            ReclaimAction::Replace => next.slot = Block::B,
            ReclaimAction::Scan => next.extent = Extent::Scanned,
            ReclaimAction::Snapshot => {
                let waited_for = next.word.2 && !next.reads_fenced;
                next.extent = Extent::Candidate(waited_for.then_some(next.word.0));
            }
            ReclaimAction::Free => next.extent = Extent::Free,
            ReclaimAction::Reuse => next.extent = Extent::Reused,
            ReclaimAction::FreeGrant => next.grant = Extent::Free,
            ReclaimAction::ReuseGrant => next.grant = Extent::Reused,
            ReclaimAction::Fence => self.fence(&mut next),
        }
        Some(next)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(NO_REUSED_READ, |_, state: &ReclaimState| {
                Self::holds(NO_REUSED_READ, state)
            }),
            Property::always(NO_WRITE_INTO_REUSED, |_, state: &ReclaimState| {
                Self::holds(NO_WRITE_INTO_REUSED, state)
            }),
        ]
    }
}

/// What one check found: the states explored and, for each violated property, the actions
/// that reach a violation.
#[derive(Debug, Clone)]
pub struct ReclaimReport {
    /// The model checked.
    pub model: ReclaimModel,
    /// Distinct states explored.
    pub unique_states: usize,
    /// Each property with the actions of its counterexample, if violated.
    pub verdicts: Vec<(&'static str, Option<Vec<ReclaimAction>>)>,
}

impl ReclaimReport {
    /// Whether every property holds.
    pub fn all_hold(&self) -> bool {
        self.verdicts.iter().all(|(_, path)| path.is_none())
    }
}

impl fmt::Display for ReclaimReport {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            formatter,
            "reclaim: fabric {:?}, fence {}: {} states",
            self.model.fabric, self.model.rule, self.unique_states
        )?;
        for (property, path) in &self.verdicts {
            match path {
                None => writeln!(formatter, "  holds:    {property}")?,
                Some(actions) => {
                    writeln!(formatter, "  VIOLATED: {property}")?;
                    let mut state = ReclaimModel::initial();
                    for action in actions {
                        if let Some(next) = self.model.next_state(&state, *action) {
                            state = next;
                        }
                        writeln!(formatter, "    {action:?}: {state:?}")?;
                        if !ReclaimModel::holds(property, &state) {
                            break;
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// Explores every reachable state of `model`.
pub fn check(model: ReclaimModel) -> ReclaimReport {
    let checker = model.checker().spawn_bfs().join();
    let mut discoveries = checker.discoveries();
    let verdicts = [NO_REUSED_READ, NO_WRITE_INTO_REUSED]
        .into_iter()
        .map(|property| {
            let path = discoveries.remove(property).map(|path| path.into_actions());
            (property, path)
        })
        .collect();
    ReclaimReport {
        model,
        unique_states: checker.unique_state_count(),
        verdicts,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn verdict(fabric: Fabric, rule: FenceRule) -> ReclaimReport {
        check(ReclaimModel { fabric, rule })
    }

    fn violated(report: &ReclaimReport) -> Vec<&'static str> {
        report
            .verdicts
            .iter()
            .filter(|(_, path)| path.is_some())
            .map(|(property, _)| *property)
            .collect()
    }

    /// The properties each rule violates on each fabric (`ResponderRuns`, `RequesterRuns`,
    /// `RequesterRunsUnchecked`).
    fn expected(rule: FenceRule) -> [Vec<&'static str>; 3] {
        let both = || vec![NO_REUSED_READ, NO_WRITE_INTO_REUSED];
        match rule {
            FenceRule::Ordered => [vec![], vec![], vec![NO_REUSED_READ]],
            FenceRule::WaitForOut | FenceRule::Never => [vec![], vec![], vec![]],
            FenceRule::DrainBounded => [vec![], vec![NO_WRITE_INTO_REUSED], both()],
            FenceRule::ReleaseFirst => [both(), both(), both()],
        }
    }

    #[test]
    fn each_rule_holds_or_fails_where_expected() {
        for rule in FenceRule::ALL {
            for (fabric, expected) in Fabric::ALL.into_iter().zip(expected(rule)) {
                let report = verdict(fabric, rule);
                assert_eq!(violated(&report), expected, "{report}");
                assert!(report.unique_states > 50, "{report}");
            }
        }
    }

    #[test]
    fn the_fence_as_built_needs_the_check_after_a_read_where_the_requester_runs_it() {
        let report = verdict(Fabric::RequesterRunsUnchecked, FenceRule::Ordered);
        assert_eq!(violated(&report), vec![NO_REUSED_READ], "{report}");
        assert!(verdict(Fabric::RequesterRuns, FenceRule::Ordered).all_hold());
    }

    #[test]
    fn the_stopped_client_can_still_read_the_old_block_and_fail_after_a_fence() {
        let model = ReclaimModel {
            fabric: Fabric::RequesterRuns,
            rule: FenceRule::Ordered,
        };
        let mut returned_a = false;
        let mut failed_after_fence = false;
        let mut reused_both = false;
        // Reachability: the outcomes that make the properties worth checking all occur.
        let mut pending = vec![ReclaimModel::initial()];
        let mut seen = std::collections::HashSet::new();
        while let Some(state) = pending.pop() {
            if !seen.insert(state.clone()) {
                continue;
            }
            returned_a |= state.returned == Some(Block::A) && state.fence == FenceStage::Done;
            failed_after_fence |= state.failed && state.fence != FenceStage::None;
            reused_both |= state.extent == Extent::Reused && state.grant == Extent::Reused;
            let mut actions = Vec::new();
            model.actions(&state, &mut actions);
            for action in actions {
                if let Some(next) = model.next_state(&state, action) {
                    pending.push(next);
                }
            }
        }
        assert!(returned_a && failed_after_fence && reused_both);
    }

    #[test]
    fn fence_rule_names_round_trip() {
        for rule in FenceRule::ALL {
            assert_eq!(rule.to_string().parse::<FenceRule>(), Ok(rule));
        }
        assert!("sometimes".parse::<FenceRule>().is_err());
    }
}
