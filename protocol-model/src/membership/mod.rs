//! An exhaustive model check of a membership change and the key move it makes
//! (`docs/protocol.md`, *Membership changes*): a node joins (`filling`, refilled through the
//! primary's lock, then `Promote`) or a member leaves (`Retire`, the hand-over through the
//! primary's lock, then `RemoveMember`), while clients that route by views of their own read and
//! write the key, and a node may crash at any step of the move.
//!
//! # The model
//!
//! Three nodes, `n1` to `n3`, and one key `K` ranked `[n1, n2, n3]` (every order of the steps is
//! explored, so one ranking stands for all); `n1` is the node that moves: it joins (the others
//! are members) or leaves (all three are). Each node holds one slot word for `K`: a value (or
//! none), the block it lies in, and whether it is locked. Atomic steps, in any order:
//!
//! - **the leader commits a view** (the views form one list; a view is each node's member
//!   state): the change's first (`n1` joining, or leaving), its last (`Promote` of the refilled
//!   `n1`, or `RemoveMember` once its hand-over asked for it), and `down` for a node that
//!   crashed;
//! - **a node applies the next view** it has not applied, one at a time, so nodes lag; applying
//!   a view ends every connection made under an older one (the fence). A node serves data while
//!   it runs, has not stopped serving, the view it applied has it serving, joining or leaving,
//!   and it is not a promoted node waiting for the members to apply its promotion (below);
//! - **a client learns a view** a node has applied, when newer than its own (a fetch, a
//!   welcome, a fence notice): it routes by the view it last learned, which may be older than
//!   the newest;
//! - **a client step**: each access to one node's slot is one step (the primary's READ, each
//!   backup's READ, the lock CAS, each backup CAS, the re-READ and lock check after a failed
//!   backup CAS, the commit), as in [`crate::replication`]. An operation runs under the view
//!   its client routes by; an access to a node that applied a newer view fails (the node fenced
//!   the connection, or welcomes a new one with its view, which the client waits for), as does
//!   one to a node that does not serve, and the operation
//!   resumes (a lock holder whose primary stays), starts again, or ends unresolved (a lock
//!   holder whose primary moved, or a write a backup took before its primary moved), as the
//!   client does;
//! - **the move's own steps** (the refill on the joining node, the hand-over on the leaving
//!   one): take the leader's newest view as the plan, wait until the members applied it, read
//!   the key's slot (the primary's for a refill, the node's own for a hand-over), copy it
//!   through the primary's lock (a compare-and-swap of the value with itself, a client
//!   operation of the history), check that the view did not move (else start over), then (a
//!   leaving node, as built) stop serving, and ask the leader to finish; once `Promote` is
//!   committed, a promoted node serves nothing (as built: once it applied that view itself)
//!   until every member not `down` in the view it applied applied the promotion's
//!   (`confirm_promotion` in `server/src/refill.rs`), a crash committed down meanwhile
//!   dropping out of the wait;
//! - **a node crashes** (scenarios `*-crash`, once, at any step once the change began): its
//!   slot is gone and every access to it fails; the leader may then commit it `down`.
//!
//! Routing is `client/src/view_following.rs`'s: with two copies, the first two of the ranking
//! over the members serving or leaving, plus (while one joins or leaves) the first two of the
//! ranking over those serving or joining, the first copy the primary, which GETs read; with
//! one copy, the first of the ranking over the members not joining, then the first over those
//! not leaving.
//!
//! Writers do not steal locks here (a writer that finds a lock reads again), except the lock of
//! a refill whose node crashed: its write puts back the value it found, so the takeover's
//! rollback changes no value, and it is one step. Steals and rollbacks among live writers are
//! [`crate::replication`]'s.
//!
//! # The properties
//!
//! - [`LINEARIZABLE`]: the history of the clients' operations and the move's copies is
//!   linearizable (a read returns the latest acknowledged write or a concurrent one);
//! - [`NO_WRITE_LOST`]: once the move ended (no member joining or leaving, every client done,
//!   every crashed node `down`), the key's copy by the newest view, if its node runs, holds the
//!   last acknowledged write, or a later write left unresolved.
//!
//! # The rules ([`MoveRule`])
//!
//! [`MoveRule::Built`] is the design; the others show why each part of it is needed, or try a
//! fix for a problem the design leaves (see `docs/protocol.md`, *Model check* of *Membership
//! changes*, for what the checker finds).

mod check;
mod cluster;
mod operation;
mod routing;

use std::fmt;

use stateright::semantics::LinearizabilityTester;
use stateright::{Model, Property};

use crate::client::OperationId;
use crate::key_value::{Key, KeyValueSpec, Operation, Value, ValueSet};
use crate::scenario::{get, put};

pub use check::{check, MembershipReport};
pub use routing::{route, Route};

/// Property: the history is linearizable.
pub const LINEARIZABLE: &str = "linearizable across the membership change";
/// Property: once the move ended, the key's copy holds every acknowledged write.
pub const NO_WRITE_LOST: &str = "no acknowledged write lost once the move ended";
/// Every property, in the order reports list them.
pub const PROPERTIES: [&str; 2] = [LINEARIZABLE, NO_WRITE_LOST];

/// The nodes.
pub const NODES: usize = 3;
/// `K`'s ranking: node indices, the most preferred first.
const RANKING: [usize; NODES] = [0, 1, 2];
/// The node that joins or leaves: first in `K`'s ranking, so `K` moves to it or away from it.
const MOVING: usize = 0;
/// The key every client reads and writes.
const KEY: Key = Key(1);
/// The value `K` holds before any client starts.
const INITIAL: Value = Value(1);

/// Which membership change moves the key.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Move {
    /// `n1` joins: `filling`, refilled, promoted.
    Join,
    /// `n1` leaves: `leaving`, hands over, removed.
    Leave,
}

/// A variant of the move's rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MoveRule {
    /// As built: the copy goes through the primary's lock once every member applied the
    /// change's first view; a leaving node stops serving (its lease word 0, its connections
    /// fenced) after its hand-over, before it asks for `RemoveMember`; and a joining node serves
    /// nothing (as primary or backup) from the moment it asks for its promotion until every
    /// member not `down` in its view applied the view that promotes it.
    Built,
    /// A promoted node serves as soon as it applies the view that promotes it (the join as
    /// first built).
    PromotedServesAtOnce,
    /// The promoted node stops serving only once it applied the view that promotes it, then
    /// waits for every member to apply it (the join as built next): before it applies that
    /// view, it serves as a filling member to a client that learned the promotion elsewhere.
    GatedOnceApplied,
    /// A removed node serves until it applies the view without it (the leave as first built).
    ServesUntilApplied,
    /// With one copy, the view right after `Promote` (served at once) also writes the key's holder by the view
    /// before (the old holder kept as a backup for one epoch).
    OldHolderBackup,
    /// The copy WRITEs the value it read to the key's next copies, without the primary's lock.
    UnlockedCopy,
    /// The hand-over does not wait for every member to apply the leaving view.
    NoWait,
    /// A client uses a node only while the node applied the very view its operation runs
    /// under: one whose view is older waits for it (as one whose view is newer does today); a
    /// promoted node serves at once.
    SameView,
    /// [`MoveRule::SameView`] and [`MoveRule::OldHolderBackup`] together.
    SameViewOldHolderBackup,
}

impl MoveRule {
    /// Every rule, the built one first.
    pub const ALL: [MoveRule; 9] = [
        MoveRule::Built,
        MoveRule::PromotedServesAtOnce,
        MoveRule::GatedOnceApplied,
        MoveRule::ServesUntilApplied,
        MoveRule::OldHolderBackup,
        MoveRule::UnlockedCopy,
        MoveRule::NoWait,
        MoveRule::SameView,
        MoveRule::SameViewOldHolderBackup,
    ];

    /// Whether a promoted node serves only once every member not down applied its promotion:
    /// not in the rules that serve it at once, the old join and the fixes weighed instead.
    fn promotion_waits(self) -> bool {
        !matches!(
            self,
            MoveRule::PromotedServesAtOnce
                | MoveRule::SameView
                | MoveRule::OldHolderBackup
                | MoveRule::SameViewOldHolderBackup
        )
    }

    /// Whether a joining node serves nothing from its promotion request on.
    fn gated_at_ask(self) -> bool {
        self == MoveRule::Built
    }

    /// Whether a client uses a node only at the view its operation runs under.
    fn same_view(self) -> bool {
        matches!(self, MoveRule::SameView | MoveRule::SameViewOldHolderBackup)
    }

    /// Whether a `Promote` view's writes also reach the holder by the view before.
    fn old_holder_backup(self) -> bool {
        matches!(
            self,
            MoveRule::OldHolderBackup | MoveRule::SameViewOldHolderBackup
        )
    }
}

impl fmt::Display for MoveRule {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter.write_str(match self {
            MoveRule::Built => "built",
            MoveRule::PromotedServesAtOnce => "promoted-serves-at-once",
            MoveRule::GatedOnceApplied => "gated-once-applied",
            MoveRule::ServesUntilApplied => "serves-until-applied",
            MoveRule::OldHolderBackup => "old-holder-backup",
            MoveRule::UnlockedCopy => "unlocked-copy",
            MoveRule::NoWait => "no-wait",
            MoveRule::SameView => "same-view",
            MoveRule::SameViewOldHolderBackup => "same-view-old-holder-backup",
        })
    }
}

impl std::str::FromStr for MoveRule {
    type Err = String;

    fn from_str(name: &str) -> std::result::Result<Self, Self::Err> {
        MoveRule::ALL
            .into_iter()
            .find(|rule| rule.to_string() == name)
            .ok_or_else(|| {
                format!(
                    "unknown move rule `{name}`: built, \
                     promoted-serves-at-once, gated-once-applied, serves-until-applied, old-holder-backup, \
                     unlocked-copy, no-wait, same-view or same-view-old-holder-backup"
                )
            })
    }
}

/// A node's state in one view.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemberState {
    /// Not a member.
    Absent,
    /// Filling as a new member: every write of its keys reaches it; it is never a primary.
    Joining,
    /// Serving.
    Serving,
    /// Serving while it hands its keys over.
    Leaving,
    /// Committed down (it crashed).
    Down,
}

impl MemberState {
    /// Whether a node that applied a view with it in this state serves data.
    fn serves_data(self) -> bool {
        matches!(
            self,
            MemberState::Joining | MemberState::Serving | MemberState::Leaving
        )
    }
}

/// One committed view; its epoch is its place in the list.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct View {
    /// Each node's state.
    pub states: [MemberState; NODES],
    /// Whether this view is a `Promote`.
    pub promoted: bool,
}

/// A node's slot word for `K`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Word {
    /// The value its block holds (`None`: absent).
    pub value: Option<Value>,
    /// The block: every write gets one of its own, so a committed word never comes back.
    pub block: u8,
    /// Whether a writer holds it as its lock (readers return its value).
    pub locked: bool,
}

impl Word {
    /// The slot of a node that never held `K`.
    const EMPTY: Word = Word {
        value: None,
        block: 0,
        locked: false,
    };
}

/// One node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Node {
    /// The last view it applied.
    pub applied: u8,
    /// Whether it runs (a crash is for good).
    pub alive: bool,
    /// Whether it stopped serving of its own accord (a leaving node after its hand-over).
    pub stopped: bool,
    /// Its slot word for `K`.
    pub word: Word,
}

/// Where a client is in its operation. Each stage is one access to one node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stage {
    /// Between operations: the next step invokes the next one.
    Idle,
    /// READ the primary's word (a GET returns it).
    ReadPrimary,
    /// READ the `n`-th backup's word, which its CAS will expect.
    ReadBackup(u8),
    /// Lock CAS on the primary.
    Lock,
    /// CAS the `n`-th backup from the word read to the write's.
    Swap(u8),
    /// READ the `n`-th backup again after a failed CAS (or a resume).
    Reread(u8),
    /// Check the lock on the primary, the `n`-th backup read again as the word.
    Check(u8, Word),
    /// Commit CAS on the primary.
    Commit,
    /// Take over a crashed refill's lock (the word): unlock to the value under it.
    Steal(Word),
    /// The script is done.
    Finished,
}

/// One client: a script's, or the move's own for its copies.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Client {
    /// The view it routes by (the last it learned).
    pub view: u8,
    /// The operation in progress or next (its place in the script, or the move's copy round).
    pub operation: u8,
    /// What it does next.
    pub stage: Stage,
    /// The view its operation runs under.
    pub epoch: u8,
    /// The primary's word read.
    pub seen: Option<Word>,
    /// Each backup's word as read, which its CAS expects.
    pub expected: [Option<Word>; NODES],
    /// The lock it placed: the node and the lock word.
    pub lock: Option<(u8, Word)>,
    /// Whether a backup took the operation's value in any attempt.
    pub placed: bool,
}

/// Where the move's own task (the refill, or the hand-over) is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CopierStage {
    /// Not started, or starting over.
    Idle,
    /// Waiting until the members applied its plan.
    Waiting,
    /// READ of the key's slot to copy.
    Scanning,
    /// Its copy (a client operation) runs.
    Copying,
    /// Checking that the view did not move.
    Verifying,
    /// A leaving node stops serving.
    Stopping,
    /// Asked the leader to finish the change.
    Asking,
    /// Promoted, the node serves nothing until every member not down in its view applied the
    /// promotion (the plan is then the promotion's epoch).
    Confirming,
    /// The leader finished it.
    Done,
}

/// The move's own task.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Copier {
    /// Where it is.
    pub stage: CopierStage,
    /// The view it plans by.
    pub plan: u8,
    /// Copies started so far (each is an operation of the history).
    pub rounds: u8,
    /// The value its copy writes.
    pub value: Option<Value>,
}

/// One state.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct MembershipState {
    /// The committed views, the newest last.
    pub views: Vec<View>,
    /// The nodes.
    pub nodes: [Node; NODES],
    /// The scripts' clients, then the move's own.
    pub clients: Vec<Client>,
    /// The move's own task.
    pub copier: Copier,
    /// Whether a node crashed.
    pub crashed: bool,
    /// The history so far.
    pub history: LinearizabilityTester<OperationId, KeyValueSpec>,
    /// Whether the history is still linearizable.
    pub linearizable: bool,
    /// The value of the last write of a script acknowledged (`None`: none yet).
    pub acknowledged: Option<Value>,
    /// The values of the scripts' writes left unresolved (they may have applied).
    pub unresolved: ValueSet,
}

impl MembershipState {
    /// The newest view's epoch.
    fn newest(&self) -> u8 {
        (self.views.len() - 1) as u8
    }

    /// The newest view.
    fn newest_view(&self) -> View {
        self.views[self.views.len() - 1]
    }

    /// Whether node `node` serves data under `rule`: not a promoted node that applied its
    /// promotion while it waits for the members to apply it ([`CopierStage::Confirming`]), nor,
    /// under [`MoveRule::Built`], one that asked for its promotion.
    fn serves(&self, node: usize, rule: MoveRule) -> bool {
        let current = &self.nodes[node];
        let own = self.views[usize::from(current.applied)].states[node];
        let stage = self.copier.stage;
        let gated = node == MOVING
            && ((stage == CopierStage::Confirming && own == MemberState::Serving)
                || (rule.gated_at_ask()
                    && matches!(stage, CopierStage::Asking | CopierStage::Confirming)));
        current.alive && !current.stopped && !gated && own.serves_data()
    }
}

/// One step.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MembershipAction {
    /// Client `n` (the move's own last) takes its next step.
    Step(u8),
    /// Client `client` learns the view of `epoch`, which a node applied.
    Learn {
        /// The client.
        client: u8,
        /// The view's epoch.
        epoch: u8,
    },
    /// Node `n` applies the next view.
    Apply(u8),
    /// The leader commits the change's first view.
    Begin,
    /// The leader commits the change's last view (`Promote`, `RemoveMember`).
    Finish,
    /// Node `n` crashes.
    Crash(u8),
    /// The leader commits node `n` down.
    MarkDown(u8),
    /// The move's own task takes its next step.
    Copier,
}

/// A scenario: the change, the copies per key, whether a node crashes, the rule, the scripts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MembershipModel {
    /// The scenario's name.
    pub name: &'static str,
    /// The change.
    pub change: Move,
    /// Copies per key (1 or 2).
    pub replicas: usize,
    /// Whether one node may crash at any step once the change began.
    pub crash: bool,
    /// The rule.
    pub rule: MoveRule,
    /// Each script client's operations.
    pub scripts: Vec<Vec<Operation>>,
}

impl MembershipModel {
    /// The scenarios under `rule`: `join` and `leave`, each with two copies or one
    /// (`-one-copy`), each without or with a crash (`-crash`). Scripts: a writer of one put and a
    /// reader of two gets (one with a crash).
    pub fn scenarios(rule: MoveRule) -> Vec<MembershipModel> {
        let scenario = |name, change, replicas, crash: bool| MembershipModel {
            name,
            change,
            replicas,
            crash,
            rule,
            scripts: if crash {
                vec![vec![put(1, 11)], vec![get(1)]]
            } else {
                vec![vec![put(1, 11)], vec![get(1), get(1)]]
            },
        };
        vec![
            scenario("join", Move::Join, 2, false),
            scenario("join-crash", Move::Join, 2, true),
            scenario("join-one-copy", Move::Join, 1, false),
            scenario("join-one-copy-crash", Move::Join, 1, true),
            scenario("leave", Move::Leave, 2, false),
            scenario("leave-crash", Move::Leave, 2, true),
            scenario("leave-one-copy", Move::Leave, 1, false),
            scenario("leave-one-copy-crash", Move::Leave, 1, true),
        ]
    }

    /// The scenario named `name` under `rule`.
    ///
    /// # Errors
    /// A line naming the scenarios when none is called `name`.
    pub fn named(name: &str, rule: MoveRule) -> std::result::Result<MembershipModel, String> {
        let scenarios = Self::scenarios(rule);
        let known: Vec<&str> = scenarios.iter().map(|model| model.name).collect();
        scenarios
            .iter()
            .find(|model| model.name == name)
            .cloned()
            .ok_or_else(|| format!("unknown scenario `{name}`: {}", known.join(", ")))
    }

    /// The index of the move's own client.
    fn copier_client(&self) -> usize {
        self.scripts.len()
    }

    /// The first view: with `n1` absent (a join) or serving (a leave), the others serving.
    fn first_view(&self) -> View {
        let moving = match self.change {
            Move::Join => MemberState::Absent,
            Move::Leave => MemberState::Serving,
        };
        let mut states = [MemberState::Serving; NODES];
        states[MOVING] = moving;
        View {
            states,
            promoted: false,
        }
    }

    /// The initial state: every node at the first view, `K` holding `v1` on its copies by it.
    pub fn initial(&self) -> MembershipState {
        let views = vec![self.first_view()];
        let holders = route(&views, 0, self.replicas, self.rule).copies;
        let nodes = std::array::from_fn(|node| Node {
            applied: 0,
            alive: true,
            stopped: false,
            word: if holders.contains(&node) {
                Word {
                    value: Some(INITIAL),
                    block: 1,
                    locked: false,
                }
            } else {
                Word::EMPTY
            },
        });
        let client = Client {
            view: 0,
            operation: 0,
            stage: Stage::Idle,
            epoch: 0,
            seen: None,
            expected: [None; NODES],
            lock: None,
            placed: false,
        };
        MembershipState {
            views,
            nodes,
            clients: vec![client; self.scripts.len() + 1],
            copier: Copier {
                stage: CopierStage::Idle,
                plan: 0,
                rounds: 0,
                value: None,
            },
            crashed: false,
            history: LinearizabilityTester::new(KeyValueSpec::new([(KEY, INITIAL)])),
            linearizable: true,
            acknowledged: None,
            unresolved: ValueSet::default(),
        }
    }

    /// The key's route under the view of `epoch`.
    fn route_at(&self, state: &MembershipState, epoch: u8) -> Route {
        route(&state.views, epoch, self.replicas, self.rule)
    }
}

impl Model for MembershipModel {
    type State = MembershipState;
    type Action = MembershipAction;

    fn init_states(&self) -> Vec<MembershipState> {
        vec![self.initial()]
    }

    fn actions(&self, state: &MembershipState, actions: &mut Vec<MembershipAction>) {
        self.client_actions(state, actions);
        self.cluster_actions(state, actions);
    }

    fn next_state(
        &self,
        state: &MembershipState,
        action: MembershipAction,
    ) -> Option<MembershipState> {
        let mut next = state.clone();
        match action {
            MembershipAction::Step(client) => self.step(&mut next, usize::from(client)),
            MembershipAction::Learn { client, epoch } => {
                next.clients[usize::from(client)].view = epoch;
            }
            MembershipAction::Apply(node) => next.nodes[usize::from(node)].applied += 1,
            MembershipAction::Begin | MembershipAction::Finish | MembershipAction::MarkDown(_) => {
                self.commit_view(&mut next, action);
            }
            MembershipAction::Crash(node) => {
                next.nodes[usize::from(node)].alive = false;
                next.crashed = true;
            }
            MembershipAction::Copier => self.copier_step(&mut next),
        }
        Some(next)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        vec![
            Property::always(LINEARIZABLE, |_, state: &MembershipState| {
                state.linearizable
            }),
            Property::always(NO_WRITE_LOST, |model: &MembershipModel, state| {
                model.nothing_lost(state)
            }),
        ]
    }
}

#[cfg(test)]
mod tests;
