//! Running the lease model's exhaustive check and reporting its verdicts.
//!
//! [`check`] runs stateright's breadth-first checker over every reachable state of a
//! [`LeaseModel`] and turns each property's discovery into a [`LeaseCounterexample`]: the path
//! from the initial state, cut at the first state that violates the property, each step
//! described in words (who did what, what it read, what it decided) with the state after it.

use std::fmt;
use std::time::{Duration, Instant};

use stateright::{Checker, Model};

use crate::key_value::Value;

use super::{
    Attempt, LeaseAction, LeaseModel, LeaseState, Node, ReaderStage, ServingWord, WriterStage,
};

/// One step of a counterexample.
#[derive(Clone, Debug)]
pub struct LeaseStep {
    /// What the step did, in words.
    pub description: String,
    /// The action taken.
    pub action: LeaseAction,
    /// The state after the step.
    pub state: LeaseState,
}

/// A path from the initial state to a state that violates a property.
#[derive(Clone, Debug)]
pub struct LeaseCounterexample {
    /// The state at the start.
    pub initial: LeaseState,
    /// The steps, in order; the state after the last one violates the property.
    pub steps: Vec<LeaseStep>,
}

impl LeaseCounterexample {
    /// The actions taken, in order.
    pub fn actions(&self) -> Vec<LeaseAction> {
        self.steps.iter().map(|step| step.action).collect()
    }
}

impl fmt::Display for LeaseCounterexample {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        let width = self
            .steps
            .iter()
            .map(|step| step.description.len())
            .max()
            .unwrap_or(0);
        writeln!(
            formatter,
            "{:>4}  {:<width$}  state after",
            "step", "action"
        )?;
        writeln!(
            formatter,
            "{:>4}  {:<width$}  {}",
            0, "(start)", self.initial
        )?;
        for (index, step) in self.steps.iter().enumerate() {
            writeln!(
                formatter,
                "{:>4}  {:<width$}  {}",
                index + 1,
                step.description,
                step.state
            )?;
        }
        Ok(())
    }
}

/// Whether one property held, with a counterexample when it did not.
#[derive(Clone, Debug)]
pub struct LeaseVerdict {
    /// The property's name.
    pub property: &'static str,
    /// `None` when the property held in every reachable state.
    pub counterexample: Option<LeaseCounterexample>,
}

/// The result of checking one lease scenario.
#[derive(Clone, Debug)]
pub struct LeaseReport {
    /// The model checked.
    pub model: LeaseModel,
    /// Distinct states reached.
    pub unique_states: usize,
    /// States generated, counting repeats.
    pub generated_states: usize,
    /// The longest path explored, in steps.
    pub max_depth: usize,
    /// Wall-clock time of the search.
    pub elapsed: Duration,
    /// One verdict per property, in the model's property order.
    pub verdicts: Vec<LeaseVerdict>,
}

impl LeaseReport {
    /// Whether every property held.
    pub fn all_hold(&self) -> bool {
        self.verdicts
            .iter()
            .all(|verdict| verdict.counterexample.is_none())
    }

    /// Whether the search visited every reachable state: it stops early only once every
    /// property has a counterexample.
    pub fn is_exhaustive(&self) -> bool {
        self.verdicts
            .iter()
            .any(|verdict| verdict.counterexample.is_none())
    }

    /// The names of the properties with a counterexample.
    pub fn violated(&self) -> Vec<&'static str> {
        self.verdicts
            .iter()
            .filter(|verdict| verdict.counterexample.is_some())
            .map(|verdict| verdict.property)
            .collect()
    }

    /// The counterexample found for `property`, if any.
    pub fn counterexample(&self, property: &str) -> Option<&LeaseCounterexample> {
        self.verdicts
            .iter()
            .find(|verdict| verdict.property == property)
            .and_then(|verdict| verdict.counterexample.as_ref())
    }

    /// The scenario's header lines: its settings and the clients' scripts.
    fn write_scenario(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        let model = &self.model;
        writeln!(
            formatter,
            "scenario {} under the {} reader rule",
            model.name, model.rule
        )?;
        writeln!(formatter, "  {}", model.summary)?;
        writeln!(
            formatter,
            "  clock to {}, lease {} ticks, view change once t > E + {}, retry budget {}, node 1 \
             {}",
            model.horizon,
            model.lease_length,
            model.margin,
            model.retry_budget,
            if model.teardown {
                "ends its connections when it stops serving"
            } else {
                "leaves its connections open when it stops serving"
            }
        )?;
        let puts: Vec<String> = (0..model.writes.len())
            .map(|index| model.put(index as u8).to_string())
            .collect();
        writeln!(
            formatter,
            "  c1 (writer, by the newest view): {}",
            puts.join(", ")
        )?;
        for (index, gets) in model.gets.iter().enumerate() {
            let script = vec!["get(k1)"; usize::from(*gets)].join(", ");
            writeln!(
                formatter,
                "  c{} (reader, connected to node 1 only): {script}",
                index + 2
            )?;
        }
        Ok(())
    }
}

impl fmt::Display for LeaseReport {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.write_scenario(formatter)?;
        let complete = if self.is_exhaustive() {
            "every reachable state"
        } else {
            "stopped early: every property already had a counterexample"
        };
        writeln!(
            formatter,
            "explored {} unique states ({} generated, depth {}) in {:.2} s ({complete})",
            self.unique_states,
            self.generated_states,
            self.max_depth,
            self.elapsed.as_secs_f64()
        )?;
        for verdict in &self.verdicts {
            let result = if verdict.counterexample.is_some() {
                "VIOLATED"
            } else {
                "holds"
            };
            writeln!(formatter, "  {result:<8}  {}", verdict.property)?;
        }
        let mut printed: Vec<(&'static str, &LeaseCounterexample)> = Vec::new();
        for verdict in &self.verdicts {
            let Some(counterexample) = &verdict.counterexample else {
                continue;
            };
            let same = printed
                .iter()
                .find(|(_, earlier)| earlier.actions() == counterexample.actions());
            if let Some((earlier, _)) = same {
                writeln!(
                    formatter,
                    "\ncounterexample: {}: the same {} steps as for {earlier}",
                    verdict.property,
                    counterexample.steps.len()
                )?;
                continue;
            }
            writeln!(
                formatter,
                "\ncounterexample: {} ({} steps; word (S,E) = serving since S until at least E)",
                verdict.property,
                counterexample.steps.len()
            )?;
            write!(formatter, "{counterexample}")?;
            printed.push((verdict.property, counterexample));
        }
        Ok(())
    }
}

/// Explores every reachable state of `model` with `threads` checker threads.
///
/// The search stops early only when every property already has a counterexample.
pub fn check(model: &LeaseModel, threads: usize) -> LeaseReport {
    let started = Instant::now();
    let checker = model
        .clone()
        .checker()
        .threads(threads.max(1))
        .spawn_bfs()
        .join();
    let elapsed = started.elapsed();
    let mut discoveries = checker.discoveries();
    let verdicts = model
        .property_names()
        .into_iter()
        .map(|property| LeaseVerdict {
            property,
            counterexample: discoveries
                .remove(property)
                .map(|path| counterexample(model, property, path.into_actions())),
        })
        .collect();
    LeaseReport {
        model: model.clone(),
        unique_states: checker.unique_state_count(),
        generated_states: checker.state_count(),
        max_depth: checker.max_depth(),
        elapsed,
        verdicts,
    }
}

/// Replays `actions` from the initial state and stops at the first state violating `property`.
fn counterexample(
    model: &LeaseModel,
    property: &'static str,
    actions: Vec<LeaseAction>,
) -> LeaseCounterexample {
    let initial = model
        .init_states()
        .into_iter()
        .next()
        .expect("the model has one initial state");
    let mut state = initial.clone();
    let mut steps = Vec::new();
    for action in actions {
        let next = model
            .next_state(&state, action)
            .expect("every enabled action has a next state");
        steps.push(LeaseStep {
            description: describe(model, &state, action, &next),
            action,
            state: next.clone(),
        });
        state = next;
        if !model.holds(property, &state) {
            break;
        }
    }
    LeaseCounterexample { initial, steps }
}

/// What `action` did, taking `before` to `after`, in words.
pub fn describe(
    model: &LeaseModel,
    before: &LeaseState,
    action: LeaseAction,
    after: &LeaseState,
) -> String {
    match action {
        LeaseAction::Tick => "tick".to_string(),
        LeaseAction::Renew => format!("node 1's lease renewed: word {}", after.word),
        LeaseAction::StopServing if model.teardown => {
            "node 1 stops serving: word 0, connections ended".to_string()
        }
        LeaseAction::StopServing => "node 1 stops serving: word 0".to_string(),
        LeaseAction::Pause => "node 1 paused (memory and word frozen, still readable)".to_string(),
        LeaseAction::Resume => "node 1 resumed".to_string(),
        LeaseAction::ViewChange => format!(
            "view change: node 1 down (lease ran out at {}), node 2 primary",
            before.lease_until
        ),
        LeaseAction::Rejoin => format!(
            "node 1 rejoins: refilled from node 2, primary, word {}",
            after.word
        ),
        LeaseAction::Write => format!("c1 {}", describe_writer(model, before, after)),
        LeaseAction::Read(index) => {
            let index = usize::from(index);
            format!(
                "c{} {}",
                index + 2,
                describe_reader(model, before, after, index)
            )
        }
    }
}

/// The writer's step, in words.
fn describe_writer(model: &LeaseModel, before: &LeaseState, after: &LeaseState) -> String {
    let operation = before.writer.operation;
    let value = || model.writes[usize::from(operation)];
    let ended = after.writer.operation > operation;
    let acknowledged = ended && after.history != before.history;
    let ending = |what: &str| {
        if acknowledged {
            format!("{what}: returns ok")
        } else {
            format!("{what}: unresolved (may have applied)")
        }
    };
    match before.writer.stage {
        WriterStage::Idle if ended => format!(
            "invokes {}, writes node 2, the only copy: returns ok",
            model.put(operation)
        ),
        WriterStage::Idle => format!(
            "invokes {}, writes node 2 (the backup)",
            model.put(operation)
        ),
        WriterStage::Post => format!("posts its commit CAS to node 1 at t_post={}", before.now),
        WriterStage::Commit(_) if ended => ending("commit CAS on node 1 fails"),
        WriterStage::Commit(_) => format!("commit CAS lands on node 1: {}", value()),
        WriterStage::Word(_) if ended => ending("word READ of node 1 fails"),
        WriterStage::Word(_) => format!("word READ of node 1: {}", before.word),
        WriterStage::Complete(attempt) => ending(&completion(model, &attempt, before.now)),
        WriterStage::Finished => "finished".to_string(),
    }
}

/// Reader `index`'s step, in words.
fn describe_reader(
    model: &LeaseModel,
    before: &LeaseState,
    after: &LeaseState,
    index: usize,
) -> String {
    let reader = &before.readers[index];
    let next = &after.readers[index];
    let refused = match next.stage {
        ReaderStage::Retry => "; retries",
        _ => "; gives up (the get stays pending)",
    };
    let posted = |attempt: Option<Attempt>| match attempt {
        Some(attempt) => format!("posts to {} at t_post={}", attempt.node, attempt.posted_at),
        None => "posts".to_string(),
    };
    match reader.stage {
        ReaderStage::Idle => format!("invokes get(k1), {}", posted(attempt_of(next.stage))),
        ReaderStage::Retry => format!(
            "fetches the view ({}), {}",
            after.view,
            posted(attempt_of(next.stage))
        ),
        ReaderStage::Data(attempt) => match attempt_of(next.stage) {
            Some(read) => format!("data READ of {}: {}", attempt.node, shown(read.data)),
            None => format!("data READ of {} fails{refused}", attempt.node),
        },
        ReaderStage::Word(_) => match attempt_of(next.stage) {
            Some(read) => format!("word READ of node 1: {}", read.word),
            None => format!("word READ of node 1 fails{refused}"),
        },
        ReaderStage::Complete(attempt) if attempt.node == Node::Two => format!(
            "completion from node 2 at t_done={}: returns {}",
            before.now,
            shown(attempt.data)
        ),
        ReaderStage::Complete(attempt) => {
            let check = completion(model, &attempt, before.now);
            if model
                .rule
                .accepts(attempt.posted_at, attempt.word, before.now)
            {
                format!("{check}: returns {}", shown(attempt.data))
            } else {
                format!("{check}{refused}")
            }
        }
        ReaderStage::Finished => "finished".to_string(),
    }
}

/// A value read, in words.
fn shown(value: Option<Value>) -> String {
    value.map_or_else(|| "absent".to_string(), |value| value.to_string())
}

/// The attempt a stage carries, if any.
fn attempt_of(stage: ReaderStage) -> Option<Attempt> {
    match stage {
        ReaderStage::Data(attempt)
        | ReaderStage::Word(attempt)
        | ReaderStage::Complete(attempt) => Some(attempt),
        ReaderStage::Idle | ReaderStage::Retry | ReaderStage::Finished => None,
    }
}

/// The completion of a list on node 1 at `now`, and what the rule makes of it, in words.
fn completion(model: &LeaseModel, attempt: &Attempt, now: u8) -> String {
    let accepted = model.rule.accepts(attempt.posted_at, attempt.word, now);
    let verdict = if accepted { "accepted" } else { "rejected" };
    match (model.rule.reads_word(), attempt.word) {
        (false, _) => format!("completion at t_done={now}, no word checked: {verdict}"),
        (true, ServingWord::NotServing) => {
            format!("completion at t_done={now}, word 0: {verdict}")
        }
        (true, ServingWord::Serving { .. }) => format!(
            "completion at t_done={now}, t_post={}, word {} ({}): {verdict}",
            attempt.posted_at,
            attempt.word,
            model.rule.check_text()
        ),
    }
}
