//! An exhaustive model check of rdkv's index-slot protocol with [stateright].
//!
//! The model shrinks the index to what the races need: one bucket of `S` slots shared by every
//! key, two or three clients each running a short script of operations, one atomic step per slot
//! READ or slot CAS. The checker explores every interleaving of those steps and checks, in every
//! reachable state:
//!
//! - [`model::LINEARIZABLE`]: the history of invocations and returns is linearizable against a
//!   sequential key-value map ([`key_value::KeyValueSpec`]);
//! - [`model::NO_RESURRECTION`]: a value that was visible and then overwritten or deleted never
//!   becomes visible again;
//! - [`model::INSERT_EXISTS_NEVER_VISIBLE`]: an insert that reported `exists` never had its value
//!   visible;
//! - [`model::ONE_COMMITTED_SLOT_PER_KEY`] (new protocol only): no key is committed twice.
//!
//! [`model::Protocol::Old`] is the client before the fix (`client/src/operations.rs` at commit
//! `07546f6`); the checker finds
//! counterexamples to all three shared properties. [`model::Protocol::New`] is the
//! tentative-slot fix; every property holds in every scenario. [`model::Protocol::NewDraft`] is
//! the fix as first drafted, whose kill rule lets a key be committed twice.
//!
//! Layout: [`key_value`] (operations and the sequential spec), [`bucket`] (slot words),
//! [`client`] (a client's local state), `step` (one atomic step, shared logic), `old_protocol`
//! and `new_protocol` (what differs), [`model`] (the stateright model and properties),
//! [`scenario`] (the built-in scripts), [`mod@check`] (running and reporting).
//!
//! [`replication`] is a second, separate model: the replication protocol designed for issue 16
//! (intents on the primary, helping, tombstones, a failover that fences the old view), checked
//! before it is built, with three broken variants the checker catches.
//!
//! [`recovery`] extends it with versions, snapshots at any moment and a crash of every node:
//! the newest copy by version wins, the copies agree, and the key is as of its last snapshot or
//! later; a variant whose rollbacks keep the old version fails.
//!
//! [`lease`] is a third: a client that reads a node one-sidedly while the node may be paused
//! (its memory answers READs, its CPU does nothing) and the view moves the node's keys away.
//! The client before the fix returns the paused node's frozen value; the serving-lease rule
//! (a word `(S, E)` read after the data, `S < t_post`, `t_done < E`) holds.
//!
//! [`reclaim`] is a fourth: heap reclamation with announce words and the fence of a connection
//! that holds reuse back (a stopped client). Fencing as built (queue pair to ERROR, a bounded
//! drain, the word released once the requester is out, and until then no longer waited for by
//! snapshots while `shm` READs are checked after their copy) holds on both kinds of fabric;
//! without that check, releasing the grant of a requester still inside a request, or
//! releasing the word before the ERROR, the client reads or writes a reused extent.
//!
//! [`leave_order`] is a fifth: which copy decides at a whole-cluster start after nodes stopped
//! one at a time (`server/src/reconcile/authority.rs`). The rule as built loses a delete (a
//! final snapshot written after a later stop, a stand-in's delete, a stand-in's stale extra
//! copy); comparing the epochs the nodes stopped serving at holds while a home copy of the key
//! stays; newest-wins, no mutual check and any member deciding fail.
//!
//! [`membership`] is a sixth: a node joining or a member leaving, with the key moved through
//! the primary's lock, clients routing by views that lag, and a node crashing at any step of
//! the move. A leaving node that serves until it applies its removal gives a stale read; the
//! rule as built (it stops serving before it asks for the removal) holds. A join fails right
//! after `Promote` (a write shown before its commit with two copies, a stale read with one);
//! clients that use a node only at their operation's own view close the first.
//!
//! [stateright]: https://docs.rs/stateright

#![forbid(unsafe_code)]

pub mod bucket;
pub mod check;
pub mod client;
pub mod error;
pub mod key_value;
pub mod lease;
pub mod leave_order;
pub mod membership;
pub mod model;
mod new_protocol;
mod old_protocol;
pub mod reclaim;
pub mod recovery;
pub mod replication;
pub mod scenario;
pub mod step;

pub use check::{check, Counterexample, Report, Verdict};
pub use error::{Error, Result};
pub use model::{IndexModel, Protocol};
pub use scenario::Scenario;
