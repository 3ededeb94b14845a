//! An exhaustive model check of which copy decides at a whole-cluster start
//! (`docs/protocol.md`, *Reconciliation*, *Which copy decides*; `server/src/reconcile/
//! authority.rs`): after nodes stopped one at a time, or crashed, each loads its last
//! snapshot, and a final snapshot of a node that stopped serving at epoch `F` decides over an
//! older final snapshot of another copy of the key, absences included.
//!
//! # The model
//!
//! Three nodes, `replicas = 2`, one key `K` ranked `[1, 2, 3]` (nodes behave alike, and every
//! order of their stops, restarts and snapshots is explored, so one ranking stands for all).
//! The view: an epoch, and each member serving or `down`; `K`'s copies under it are the first
//! two of its ranking over the serving members. Each node: its process (serving, stopped
//! serving but running, or exited), its copy of `K` in memory (a version, or absent), the epoch
//! it stopped serving at while the view had it serving (`F`), and its snapshot on disk (the
//! copy, the header epoch `E`, `fenced_at`, and when its writing began, by one clock). Atomic
//! steps, in any order:
//!
//! - **a write or a delete** (while fewer than the scenario's operations were issued) takes the
//!   next version (one above every version so far) and reaches a non-empty set of `K`'s copies
//!   that serve; it is acknowledged only when it reaches every copy of the current view (a
//!   delete needs the primary to hold the key: one of an absent key writes nothing);
//! - **a node stops serving** (SIGTERM, or its lease lapsing with no majority left): `F` is the
//!   epoch then;
//! - **the view commits it down** (epoch + 1) while a majority of the processes runs (the
//!   leaving one counts until it exits);
//! - **it exits**, writing its final snapshot: `E` = the epoch it knows then, `fenced_at = F`;
//! - **a serving node writes a snapshot on its schedule** (`fenced_at` none);
//! - **a stand-in sweeps** its copy of `K` when it is not one of `K`'s copies
//!   (`server/src/sweep.rs`: some time after a view with nobody filling, so maybe never);
//! - **an exited node, down in the view, restarts** (the `rolling-restart` scenario), while
//!   every member the view has serving serves and a majority runs with it: it is refilled from
//!   `K`'s primary if it will hold `K` (emptied otherwise) and promoted (epoch + 1), its disk
//!   untouched (its old final snapshot stays until the next);
//! - **every process still running crashes** (kill -9: no final snapshot).
//!
//! Once every process exited, the whole cluster starts: every node loads its snapshot and every
//! member fills, and each of `K`'s holders (its first two by the filling members) runs
//! `reconcile` as built: it drops its own copy when another member's decides over it and takes
//! the newest copy no other decides over (its own included), or removes the key when there is
//! none. [`DecideRule`] says when one snapshot decides over another.
//!
//! # The properties (judged once every process exited)
//!
//! - [`CLEAN_STOPS_KEEP_EVERY_OPERATION`]: when no process crashed, each holder has `K` as the
//!   last acknowledged write or delete left it, or as a later unacknowledged one did;
//! - [`NO_SNAPSHOTTED_WRITE_GOES_BACK`]: an acknowledged write held by any node's snapshot is
//!   never replaced by an older value (each holder has it, a later write, or the absence of a
//!   later delete);
//! - [`COPIES_AGREE`]: every holder has the same copy.
//!
//! # What the checker finds
//!
//! - [`DecideRule::Built`] (`F_Q < F_X`) holds in `stops-keeping-a-home-copy` and `crash`; it
//!   loses a delete that only a stand-in acknowledged (`stops`: both of `K`'s copies by the
//!   membership down while the view still serves) and one whose stand-in kept a stale extra
//!   copy, not yet swept, and became `K`'s copy again (`rolling-restart`): the two cases
//!   `docs/protocol.md` leaves open.
//! - [`DecideRule::HeaderEpochs`] (the rule as first built) and [`DecideRule::EpochsOnly`] lose
//!   an acknowledged delete in every scenario: a node that stopped serving at `F = 2` writes its
//!   final snapshot only after a later node's leave committed, so its header says `E = 4`,
//!   above that later node's `F = 3`, and its copy of a key the later node deleted comes back.
//!   `F`, not `E`, bounds what a final snapshot holds.
//! - The broken variants of the built rule ([`DecideRule::NewestWins`],
//!   [`DecideRule::NoMutualCheck`], [`DecideRule::AnyDecider`]) fail in
//!   `stops-keeping-a-home-copy`.
//! - [`COPIES_AGREE`] holds everywhere by construction: every holder takes the newest of the
//!   same copies.

use std::fmt;

use stateright::{Checker, Model, Property};

/// Property: after clean stops, nothing acknowledged is lost or comes back.
pub const CLEAN_STOPS_KEEP_EVERY_OPERATION: &str =
    "after every node stopped cleanly, K is as its last acknowledged operation left it, or later";
/// Property: an acknowledged write in a snapshot never goes back to an older value.
pub const NO_SNAPSHOTTED_WRITE_GOES_BACK: &str =
    "no acknowledged write held by a snapshot is replaced by an older value";
/// Property: the holders agree.
pub const COPIES_AGREE: &str = "K's copies agree after the reconciliation";

/// Every property, in the order reports list them.
pub const PROPERTIES: [&str; 3] = [
    CLEAN_STOPS_KEEP_EVERY_OPERATION,
    NO_SNAPSHOTTED_WRITE_GOES_BACK,
    COPIES_AGREE,
];

/// The nodes.
const NODES: usize = 3;
/// The cluster's `replicas`.
const REPLICAS: usize = 2;
/// `K`'s ranking: node indices, first the most preferred.
const RANKING: [usize; NODES] = [0, 1, 2];

/// When one final snapshot decides over another of the same key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DecideRule {
    /// Broken, as first built: `X` decides over `Q` when both are final, `E_Q ≤ F_X`, not
    /// `E_X ≤ F_Q`, and `Q`'s writing began no later than `X`'s (header epochs bound nothing:
    /// a node keeps applying views while it tears down).
    HeaderEpochs,
    /// Broken: the same without the clocks' guard.
    EpochsOnly,
    /// As built (`authority.rs`): `X` decides over `Q` when both are final and `F_Q < F_X` (`Q`
    /// served nothing after `F_Q`, so `F_Q` bounds its copies; two equal `F`s decide nothing);
    /// `X` among `K`'s first `replicas` by the whole membership. The built rule's clocks' guard
    /// (`Q` stopped serving no later than `X`) holds in every run of one clock, where `F_Q <
    /// F_X` means `Q` stopped first.
    Built,
    /// Broken: no snapshot decides (newest-wins alone).
    NewestWins,
    /// Broken: the built rule without its mutual check (`F_Q ≤ F_X`: two copies that stopped at
    /// the same epoch each decide over the other).
    NoMutualCheck,
    /// Broken: the built rule, but any member decides, not only `K`'s copies by the membership.
    AnyDecider,
}

impl DecideRule {
    /// Every rule, the built one first.
    pub const ALL: [DecideRule; 6] = [
        DecideRule::Built,
        DecideRule::HeaderEpochs,
        DecideRule::EpochsOnly,
        DecideRule::NewestWins,
        DecideRule::NoMutualCheck,
        DecideRule::AnyDecider,
    ];

    /// Whether a snapshot of provenance `mine` decides over `other`'s.
    fn decides_over(self, mine: &Snapshot, other: &Snapshot) -> bool {
        let (Some(fenced_at), Some(other_fenced_at)) = (mine.fenced_at, other.fenced_at) else {
            return false;
        };
        let covers = other.epoch <= fenced_at;
        let covered = mine.epoch <= other_fenced_at;
        let written_before = other.written <= mine.written;
        match self {
            DecideRule::HeaderEpochs => covers && !covered && written_before,
            DecideRule::EpochsOnly => covers && !covered,
            DecideRule::Built | DecideRule::AnyDecider => other_fenced_at < fenced_at,
            DecideRule::NoMutualCheck => other_fenced_at <= fenced_at,
            DecideRule::NewestWins => false,
        }
    }
}

impl fmt::Display for DecideRule {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(match self {
            DecideRule::Built => "built",
            DecideRule::HeaderEpochs => "header-epochs",
            DecideRule::EpochsOnly => "epochs-only",
            DecideRule::NewestWins => "newest-wins",
            DecideRule::NoMutualCheck => "no-mutual-check",
            DecideRule::AnyDecider => "any-decider",
        })
    }
}

impl std::str::FromStr for DecideRule {
    type Err = String;

    fn from_str(name: &str) -> std::result::Result<Self, Self::Err> {
        DecideRule::ALL
            .into_iter()
            .find(|rule| rule.to_string() == name)
            .ok_or_else(|| {
                format!(
                    "unknown decide rule `{name}`: built, header-epochs, epochs-only, newest-wins, \
                     no-mutual-check or any-decider"
                )
            })
    }
}

/// A node's process.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Process {
    /// Serving data with a lease.
    Serving,
    /// Running, no longer serving data (leaving, or its lease lapsed).
    Stopped,
    /// Gone.
    Exited,
}

/// A node's snapshot on disk (epoch 0 and written 0: none yet).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Snapshot {
    /// `K`'s copy: its version, or `None` when absent.
    pub copy: Option<u8>,
    /// The view epoch it was written under (`E`).
    pub epoch: u8,
    /// For a final snapshot of a node that stopped serving while the view had it serving,
    /// the epoch it stopped at (`F`).
    pub fenced_at: Option<u8>,
    /// When its writing began, as a rank among the three disks' (a later one is higher).
    pub written: u8,
}

/// One node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct NodeState {
    /// Its process.
    pub process: Process,
    /// `K`'s copy in memory.
    pub copy: Option<u8>,
    /// The epoch it stopped serving at while the view had it serving.
    pub stopped_serving_at: Option<u8>,
    /// Its last snapshot.
    pub disk: Snapshot,
}

/// One state.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct LeaveOrderState {
    /// The view's epoch.
    pub epoch: u8,
    /// Which members the view has `down` (the others serve).
    pub down: [bool; NODES],
    /// The nodes.
    pub nodes: [NodeState; NODES],
    /// Versions taken so far: writes and deletes each take one (a write's copies carry it).
    pub issued: u8,
    /// The version of the last acknowledged operation (0: none, `K` absent at first).
    pub last_acknowledged: u8,
    /// The versions of acknowledged writes, a bit each.
    pub acknowledged_writes: u16,
    /// The versions of deletes that reached a copy, a bit each.
    pub applied_deletes: u16,
    /// Restarts so far.
    pub restarts: u8,
    /// Whether the processes left crashed.
    pub crashed: bool,
}

/// One step. Nodes are named 1 to 3.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LeaveOrderAction {
    /// A write reaching the nodes of the bit set (bit `i`: node `i + 1`).
    Write(u8),
    /// A delete reaching the nodes of the bit set.
    Delete(u8),
    /// The node stops serving.
    StopServing(u8),
    /// The view commits the node down.
    CommitDown(u8),
    /// The node writes its final snapshot and exits.
    Exit(u8),
    /// The node writes a snapshot on its schedule.
    Snapshot(u8),
    /// The node, a stand-in, drops its copy of `K`.
    Sweep(u8),
    /// The node restarts, is refilled and promoted.
    Restart(u8),
    /// Every running process crashes.
    CrashAll,
}

/// The model: a scenario's bounds and the rule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LeaveOrderModel {
    /// The scenario's name.
    pub name: &'static str,
    /// Writes and deletes issued at most.
    pub operations: u8,
    /// Restarts at most.
    pub restarts: u8,
    /// Whether the nodes write snapshots on a schedule and the processes left may crash
    /// (without, every node ends with its final snapshot, and one on a schedule would be
    /// replaced by it).
    pub crash: bool,
    /// Whether a view never takes the last of `K`'s copies by the whole membership down
    /// while the others still serve (no stand-in ever serves `K` alone).
    pub home_copy_stays: bool,
    /// When a snapshot decides over another.
    pub rule: DecideRule,
}

/// `K`'s copies when `serving` marks the members ranked: the first `replicas` of its ranking.
fn copies_of(serving: [bool; NODES]) -> Vec<usize> {
    RANKING
        .into_iter()
        .filter(|node| serving[*node])
        .take(REPLICAS)
        .collect()
}

/// The bit of node index `node`.
fn bit(node: usize) -> u8 {
    1 << node
}

impl LeaveOrderModel {
    /// The scenarios under `rule`, two client operations each: `stops` (every node stops
    /// cleanly, one at a time, in any order), `stops-keeping-a-home-copy` (the same, but no view
    /// takes the last of `K`'s copies by the membership down while another member serves),
    /// `rolling-restart` (that, and one node restarts once) and `crash` (that, and the
    /// processes left may crash, and serving nodes write snapshots on a schedule).
    pub fn scenarios(rule: DecideRule) -> Vec<LeaveOrderModel> {
        let scenario = |name, home_copy_stays, restarts, crash| LeaveOrderModel {
            name,
            operations: 2,
            restarts,
            crash,
            home_copy_stays,
            rule,
        };
        vec![
            scenario("stops", false, 0, false),
            scenario("stops-keeping-a-home-copy", true, 0, false),
            scenario("rolling-restart", true, 1, false),
            scenario("crash", true, 0, true),
        ]
    }

    /// The scenario named `name` under `rule`.
    ///
    /// # Errors
    /// A line naming the scenarios when none is called `name`.
    pub fn named(name: &str, rule: DecideRule) -> std::result::Result<LeaveOrderModel, String> {
        Self::scenarios(rule)
            .into_iter()
            .find(|model| model.name == name)
            .ok_or_else(|| {
                format!(
                    "unknown scenario `{name}`: stops, stops-keeping-a-home-copy, \
                     rolling-restart or crash"
                )
            })
    }

    /// Every node serving at epoch 1, `K` absent everywhere, no snapshot yet.
    pub fn initial() -> LeaveOrderState {
        let node = NodeState {
            process: Process::Serving,
            copy: None,
            stopped_serving_at: None,
            disk: Snapshot {
                copy: None,
                epoch: 0,
                fenced_at: None,
                written: 0,
            },
        };
        LeaveOrderState {
            epoch: 1,
            down: [false; NODES],
            nodes: [node; NODES],
            issued: 0,
            last_acknowledged: 0,
            acknowledged_writes: 0,
            applied_deletes: 0,
            restarts: 0,
            crashed: false,
        }
    }
}

impl LeaveOrderState {
    /// The node indices of `K`'s copies under the view.
    fn copies(&self) -> Vec<usize> {
        copies_of(self.down.map(|down| !down))
    }

    /// The processes still running.
    fn running(&self) -> usize {
        self.nodes
            .iter()
            .filter(|node| node.process != Process::Exited)
            .count()
    }

    /// Whether every process exited: the whole cluster may start.
    pub fn all_exited(&self) -> bool {
        self.running() == 0
    }

    /// Whether version `version` is an acknowledged write's.
    fn acknowledged_write(&self, version: u8) -> bool {
        self.acknowledged_writes & (1 << version) != 0
    }

    /// Whether `result` is `K` as the operation of version `floor` left it, or later: a write
    /// of that version or a later one, or absent when `floor` is a delete (or nothing yet) or
    /// a later delete reached a copy.
    fn as_of(&self, result: Option<u8>, floor: u8) -> bool {
        match result {
            Some(version) => version >= floor,
            None => !self.acknowledged_write(floor) || self.applied_deletes >> (floor + 1) != 0,
        }
    }

    /// Stamps node `node`'s disk as the latest written, keeping the stamps ranks 1, 2, ….
    fn stamp_written(&mut self, node: usize) {
        let latest = self.nodes.iter().map(|node| node.disk.written).max();
        self.nodes[node].disk.written = latest.unwrap_or(0) + 1;
        let mut stamps: Vec<u8> = self.nodes.iter().map(|node| node.disk.written).collect();
        stamps.sort_unstable();
        stamps.dedup();
        stamps.retain(|stamp| *stamp != 0);
        for node in &mut self.nodes {
            if let Some(rank) = stamps.iter().position(|stamp| *stamp == node.disk.written) {
                node.disk.written = rank as u8 + 1;
            }
        }
    }
}

impl fmt::Display for LeaveOrderState {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shown =
            |copy: Option<u8>| copy.map_or("-".to_string(), |version| format!("v{version}"));
        write!(formatter, "epoch {}, copies {:?};", self.epoch, {
            self.copies()
                .iter()
                .map(|node| node + 1)
                .collect::<Vec<_>>()
        })?;
        for (index, node) in self.nodes.iter().enumerate() {
            let view = if self.down[index] { "down" } else { "serving" };
            let process = match node.process {
                Process::Serving => "serves",
                Process::Stopped => "stopped",
                Process::Exited => "exited",
            };
            let fenced = |at: Option<u8>| at.map_or("-".to_string(), |epoch| epoch.to_string());
            write!(
                formatter,
                " node {} ({view}, {process}, K {}, F {}, disk K {} E {} F {} t {})",
                index + 1,
                shown(node.copy),
                fenced(node.stopped_serving_at),
                shown(node.disk.copy),
                node.disk.epoch,
                fenced(node.disk.fenced_at),
                node.disk.written,
            )?;
        }
        Ok(())
    }
}

impl LeaveOrderModel {
    /// Whether `source`'s loaded copy of `K` (or its absence) is decided over by another
    /// member's (`Authority::superseded`).
    fn superseded(&self, state: &LeaveOrderState, source: usize) -> bool {
        let deciders = match self.rule {
            DecideRule::AnyDecider => (0..NODES).collect(),
            _ => copies_of([true; NODES]),
        };
        let disk = |node: usize| &state.nodes[node].disk;
        deciders
            .into_iter()
            .filter(|decider| *decider != source)
            .any(|decider| self.rule.decides_over(disk(decider), disk(source)))
    }

    /// After every process exited and the whole cluster started: each of `K`'s holders (its
    /// first `replicas` by the filling members, here every member) with the copy it ends
    /// with, as `reconcile` computes it: its own copy dropped when decided over, the newest
    /// copy of the peers' scans that no other decides over kept.
    pub fn reconciled(&self, state: &LeaveOrderState) -> Vec<(usize, Option<u8>)> {
        copies_of([true; NODES])
            .into_iter()
            .map(|holder| {
                let mut copy = state.nodes[holder].disk.copy;
                let mut superseded = self.superseded(state, holder);
                for peer in (0..NODES).filter(|peer| *peer != holder) {
                    let Some(version) = state.nodes[peer].disk.copy else {
                        continue;
                    };
                    if self.superseded(state, peer) {
                        continue;
                    }
                    if superseded || copy.is_none_or(|own| version > own) {
                        copy = Some(version);
                        superseded = false;
                    }
                }
                (holder, if superseded { None } else { copy })
            })
            .collect()
    }

    /// Whether `property` holds in `state`.
    pub fn holds(&self, property: &str, state: &LeaveOrderState) -> bool {
        if !state.all_exited() {
            return true;
        }
        let reconciled = self.reconciled(state);
        match property {
            CLEAN_STOPS_KEEP_EVERY_OPERATION => {
                state.crashed
                    || reconciled
                        .iter()
                        .all(|(_, copy)| state.as_of(*copy, state.last_acknowledged))
            }
            NO_SNAPSHOTTED_WRITE_GOES_BACK => state
                .nodes
                .iter()
                .filter_map(|node| node.disk.copy)
                .filter(|version| state.acknowledged_write(*version))
                .all(|version| {
                    reconciled
                        .iter()
                        .all(|(_, copy)| state.as_of(*copy, version))
                }),
            COPIES_AGREE => reconciled.windows(2).all(|pair| pair[0].1 == pair[1].1),
            _ => true,
        }
    }

    /// The client's operations possible now: a write, or a delete when the primary holds
    /// `K`, reaching any non-empty set of the serving copies.
    fn client_actions(&self, state: &LeaveOrderState, actions: &mut Vec<LeaveOrderAction>) {
        if state.issued >= self.operations {
            return;
        }
        let copies = state.copies();
        let serving = copies
            .iter()
            .filter(|node| state.nodes[**node].process == Process::Serving)
            .fold(0u8, |set, node| set | bit(*node));
        let primary_holds = copies.first().is_some_and(|primary| {
            state.nodes[*primary].process == Process::Serving
                && state.nodes[*primary].copy.is_some()
        });
        for reached in (1..=serving).filter(|reached| reached & !serving == 0) {
            actions.push(LeaveOrderAction::Write(reached));
            if primary_holds {
                actions.push(LeaveOrderAction::Delete(reached));
            }
        }
    }

    /// Whether node `node` may restart now: exited, down in the view, a restart left, some
    /// member serving and every member the view has serving serves (it refills from them),
    /// and a majority runs with it.
    fn may_restart(&self, state: &LeaveOrderState, node: usize) -> bool {
        state.nodes[node].process == Process::Exited
            && state.down[node]
            && state.restarts < self.restarts
            && state.running() >= 1
            && !state.copies().is_empty()
            && (0..NODES)
                .filter(|member| !state.down[*member])
                .all(|member| state.nodes[member].process == Process::Serving)
    }

    /// Whether the scenario lets a view take node `node` down: always, unless it keeps a home
    /// copy and `node` is the last of `K`'s copies by the membership that the view has
    /// serving while another member serves.
    fn may_commit_down(&self, state: &LeaveOrderState, node: usize) -> bool {
        let homes = copies_of([true; NODES]);
        !self.home_copy_stays
            || !homes.contains(&node)
            || homes.iter().any(|home| *home != node && !state.down[*home])
            || (0..NODES).all(|member| member == node || state.down[member])
    }

    /// The nodes' own steps.
    fn node_actions(&self, state: &LeaveOrderState, actions: &mut Vec<LeaveOrderAction>) {
        let copies = state.copies();
        let majority = state.running() >= 2;
        for (index, node) in state.nodes.iter().enumerate() {
            let id = index as u8 + 1;
            match node.process {
                Process::Serving => {
                    actions.push(LeaveOrderAction::StopServing(id));
                    if self.crash {
                        actions.push(LeaveOrderAction::Snapshot(id));
                    }
                    if node.copy.is_some() && !copies.contains(&index) {
                        actions.push(LeaveOrderAction::Sweep(id));
                    }
                }
                Process::Stopped => actions.push(LeaveOrderAction::Exit(id)),
                Process::Exited if self.may_restart(state, index) => {
                    actions.push(LeaveOrderAction::Restart(id));
                }
                Process::Exited => {}
            }
            if node.process != Process::Serving
                && !state.down[index]
                && majority
                && self.may_commit_down(state, index)
            {
                actions.push(LeaveOrderAction::CommitDown(id));
            }
        }
        if self.crash && state.running() > 0 {
            actions.push(LeaveOrderAction::CrashAll);
        }
    }

    /// A write (`delete` false) or a delete of the next version reaching the node set
    /// `reached`.
    fn operate(state: &mut LeaveOrderState, reached: u8, delete: bool) {
        state.issued += 1;
        let version = state.issued;
        for (index, node) in state.nodes.iter_mut().enumerate() {
            if reached & bit(index) != 0 {
                node.copy = (!delete).then_some(version);
            }
        }
        if delete {
            state.applied_deletes |= 1 << version;
        }
        let every_copy = state
            .copies()
            .into_iter()
            .fold(0u8, |set, node| set | bit(node));
        if reached == every_copy {
            state.last_acknowledged = version;
            if !delete {
                state.acknowledged_writes |= 1 << version;
            }
        }
    }

    /// Node `node` restarts: refilled from `K`'s primary if it will hold `K`, promoted.
    fn restart(state: &mut LeaveOrderState, node: usize) {
        let primary = state.copies().first().copied();
        let mut serving = state.down.map(|down| !down);
        serving[node] = true;
        let holds = copies_of(serving).contains(&node);
        let refilled = primary.and_then(|primary| state.nodes[primary].copy);
        let restarted = &mut state.nodes[node];
        restarted.process = Process::Serving;
        restarted.copy = if holds { refilled } else { None };
        restarted.stopped_serving_at = None;
        state.down[node] = false;
        state.epoch += 1;
        state.restarts += 1;
    }
}

impl Model for LeaveOrderModel {
    type State = LeaveOrderState;
    type Action = LeaveOrderAction;

    fn init_states(&self) -> Vec<LeaveOrderState> {
        vec![Self::initial()]
    }

    fn actions(&self, state: &LeaveOrderState, actions: &mut Vec<LeaveOrderAction>) {
        self.client_actions(state, actions);
        self.node_actions(state, actions);
    }

    fn next_state(
        &self,
        state: &LeaveOrderState,
        action: LeaveOrderAction,
    ) -> Option<LeaveOrderState> {
        let mut next = state.clone();
        let index = |id: u8| usize::from(id) - 1;
        match action {
            LeaveOrderAction::Write(reached) => Self::operate(&mut next, reached, false),
            LeaveOrderAction::Delete(reached) => Self::operate(&mut next, reached, true),
            LeaveOrderAction::StopServing(id) => {
                let node = index(id);
                next.nodes[node].process = Process::Stopped;
                next.nodes[node].stopped_serving_at = (!next.down[node]).then_some(next.epoch);
            }
            LeaveOrderAction::CommitDown(id) => {
                next.down[index(id)] = true;
                next.epoch += 1;
            }
            LeaveOrderAction::Exit(id) | LeaveOrderAction::Snapshot(id) => {
                let node = &mut next.nodes[index(id)];
                let last = matches!(action, LeaveOrderAction::Exit(_));
                node.disk.copy = node.copy;
                node.disk.epoch = next.epoch;
                node.disk.fenced_at = node.stopped_serving_at.filter(|_| last);
                if last {
                    *node = NodeState {
                        process: Process::Exited,
                        copy: None,
                        stopped_serving_at: None,
                        disk: node.disk,
                    };
                }
                next.stamp_written(index(id));
            }
            LeaveOrderAction::Sweep(id) => next.nodes[index(id)].copy = None,
            LeaveOrderAction::Restart(id) => Self::restart(&mut next, index(id)),
            LeaveOrderAction::CrashAll => {
                for node in &mut next.nodes {
                    node.process = Process::Exited;
                    node.copy = None;
                    node.stopped_serving_at = None;
                }
                next.crashed = true;
            }
        }
        Some(next)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(
                CLEAN_STOPS_KEEP_EVERY_OPERATION,
                |model: &LeaveOrderModel, state: &LeaveOrderState| {
                    model.holds(CLEAN_STOPS_KEEP_EVERY_OPERATION, state)
                },
            ),
            Property::always(
                NO_SNAPSHOTTED_WRITE_GOES_BACK,
                |model: &LeaveOrderModel, state: &LeaveOrderState| {
                    model.holds(NO_SNAPSHOTTED_WRITE_GOES_BACK, state)
                },
            ),
            Property::always(
                COPIES_AGREE,
                |model: &LeaveOrderModel, state: &LeaveOrderState| model.holds(COPIES_AGREE, state),
            ),
        ]
    }
}

/// What one check found: the states explored, the time taken and, for each violated
/// property, the actions that reach a violation.
#[derive(Debug, Clone)]
pub struct LeaveOrderReport {
    /// The model checked.
    pub model: LeaveOrderModel,
    /// Distinct states explored.
    pub unique_states: usize,
    /// How long the check took.
    pub elapsed: std::time::Duration,
    /// Each property with the actions of its counterexample, if violated.
    pub verdicts: Vec<(&'static str, Option<Vec<LeaveOrderAction>>)>,
}

impl LeaveOrderReport {
    /// Whether every property holds.
    pub fn all_hold(&self) -> bool {
        self.verdicts.iter().all(|(_, path)| path.is_none())
    }

    /// The properties violated.
    pub fn violated(&self) -> Vec<&'static str> {
        self.verdicts
            .iter()
            .filter(|(_, path)| path.is_some())
            .map(|(property, _)| *property)
            .collect()
    }

    /// The counterexample's steps, each with the state it leads to, then what the holders
    /// reconciled to.
    fn write_trace(
        &self,
        formatter: &mut fmt::Formatter<'_>,
        actions: &[LeaveOrderAction],
    ) -> fmt::Result {
        let mut state = LeaveOrderModel::initial();
        writeln!(formatter, "    start: {state}")?;
        for action in actions {
            if let Some(next) = self.model.next_state(&state, *action) {
                state = next;
            }
            writeln!(formatter, "    {action:?}: {state}")?;
        }
        let shown = |copy: Option<u8>| copy.map_or("absent".to_string(), |v| format!("v{v}"));
        let reconciled: Vec<String> = self
            .model
            .reconciled(&state)
            .into_iter()
            .map(|(holder, copy)| format!("node {} {}", holder + 1, shown(copy)))
            .collect();
        writeln!(
            formatter,
            "    up: K reconciled to {}; last acknowledged operation: version {}",
            reconciled.join(", "),
            state.last_acknowledged
        )
    }
}

impl fmt::Display for LeaveOrderReport {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            formatter,
            "leave-order {}: rule {}: {} states in {:.2?}",
            self.model.name, self.model.rule, self.unique_states, self.elapsed
        )?;
        for (property, path) in &self.verdicts {
            match path {
                None => writeln!(formatter, "  holds:    {property}")?,
                Some(actions) => {
                    writeln!(formatter, "  VIOLATED: {property}")?;
                    self.write_trace(formatter, actions)?;
                }
            }
        }
        Ok(())
    }
}

/// Explores every reachable state of `model` with `threads` checker threads.
pub fn check(model: LeaveOrderModel, threads: usize) -> LeaveOrderReport {
    let started = std::time::Instant::now();
    let checker = model.checker().threads(threads).spawn_bfs().join();
    let mut discoveries = checker.discoveries();
    let verdicts = PROPERTIES
        .into_iter()
        .map(|property| {
            let path = discoveries.remove(property).map(|path| path.into_actions());
            (property, path)
        })
        .collect();
    LeaveOrderReport {
        model,
        unique_states: checker.unique_state_count(),
        elapsed: started.elapsed(),
        verdicts,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scenario(name: &str, rule: DecideRule) -> LeaveOrderModel {
        LeaveOrderModel::named(name, rule).expect("a built-in scenario")
    }

    const CLEAN: &str = CLEAN_STOPS_KEEP_EVERY_OPERATION;
    const SNAPSHOTTED: &str = NO_SNAPSHOTTED_WRITE_GOES_BACK;

    /// The properties each rule violates in `stops-keeping-a-home-copy`.
    fn expected(rule: DecideRule) -> Vec<&'static str> {
        match rule {
            DecideRule::Built => vec![],
            DecideRule::HeaderEpochs | DecideRule::EpochsOnly | DecideRule::NewestWins => {
                vec![CLEAN]
            }
            DecideRule::NoMutualCheck | DecideRule::AnyDecider => vec![CLEAN, SNAPSHOTTED],
        }
    }

    #[test]
    fn each_rule_holds_or_fails_where_expected_while_a_home_copy_stays() {
        for rule in DecideRule::ALL {
            let report = check(scenario("stops-keeping-a-home-copy", rule), 1);
            assert_eq!(report.violated(), expected(rule), "{report}");
            assert!(report.unique_states > 40_000, "{report}");
        }
    }

    #[test]
    fn header_epochs_lose_a_delete_everywhere_and_the_built_rule_only_where_a_stand_in_decides() {
        for name in ["stops", "rolling-restart"] {
            for rule in [DecideRule::HeaderEpochs, DecideRule::Built] {
                let report = check(scenario(name, rule), 1);
                assert_eq!(report.violated(), vec![CLEAN], "{report}");
            }
        }
        let header = check(scenario("crash", DecideRule::HeaderEpochs), 1);
        assert_eq!(header.violated(), vec![CLEAN], "{header}");
        assert!(check(scenario("crash", DecideRule::Built), 1).all_hold());
    }

    /// The first build's counterexample: a final snapshot written after a later node's stop
    /// carries an epoch above that node's `F`, though its node served nothing since its own.
    #[test]
    fn header_epochs_fail_when_a_final_snapshot_is_written_after_a_later_stop() {
        let report = check(
            scenario("stops-keeping-a-home-copy", DecideRule::HeaderEpochs),
            1,
        );
        let (_, Some(actions)) = &report.verdicts[0] else {
            panic!("{report}");
        };
        let mut state = LeaveOrderModel::initial();
        for action in actions {
            state = report.model.next_state(&state, *action).expect("a step");
        }
        let late = state.nodes.iter().any(|node| {
            node.disk.copy.is_some()
                && node
                    .disk
                    .fenced_at
                    .is_some_and(|fenced| fenced < node.disk.epoch)
        });
        assert!(late && !state.crashed, "{report}");
    }

    /// Reachability: the built rule changes the outcome of some clean run (a copy decided
    /// over is dropped where newest-wins would keep it).
    #[test]
    fn the_rule_decides_in_some_clean_run() {
        let model = scenario("stops-keeping-a-home-copy", DecideRule::Built);
        let newest = scenario("stops-keeping-a-home-copy", DecideRule::NewestWins);
        let mut pending = vec![LeaveOrderModel::initial()];
        let mut seen = std::collections::HashSet::new();
        let mut differs = false;
        while let Some(state) = pending.pop() {
            if !seen.insert(state.clone()) {
                continue;
            }
            if state.all_exited() {
                differs |= model.reconciled(&state) != newest.reconciled(&state);
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
        assert!(differs);
    }

    #[test]
    fn written_stamps_stay_ranks() {
        let mut state = LeaveOrderModel::initial();
        for node in [0, 1, 0, 2, 1] {
            state.stamp_written(node);
        }
        let stamps: Vec<u8> = state.nodes.iter().map(|node| node.disk.written).collect();
        assert_eq!(stamps, vec![1, 3, 2]);
    }

    #[test]
    fn decide_rule_names_round_trip() {
        for rule in DecideRule::ALL {
            assert_eq!(rule.to_string().parse::<DecideRule>(), Ok(rule));
        }
        assert!("sometimes".parse::<DecideRule>().is_err());
    }
}
