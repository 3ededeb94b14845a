//! Running the exhaustive check and reporting its verdicts.
//!
//! [`check`] runs stateright's breadth-first checker over every reachable state and turns each
//! property's discovery (a path from the initial state) into a [`Counterexample`]: the path
//! cut at the first state that violates the property, each step described by client,
//! operation, slot access and result, with the bucket after it.

use std::fmt;
use std::time::{Duration, Instant};

use stateright::{Checker, Model};

use crate::bucket::Bucket;
use crate::model::IndexModel;
use crate::step::Event;

/// One step of a counterexample.
#[derive(Clone, Debug)]
pub struct CounterexampleStep {
    /// What the step did.
    pub event: Event,
    /// The shared bucket after the step.
    pub bucket: Bucket,
}

/// A path from the initial state to a state that violates a property.
#[derive(Clone, Debug)]
pub struct Counterexample {
    /// The bucket at the start.
    pub initial: Bucket,
    /// The steps, in order; the state after the last one violates the property.
    pub steps: Vec<CounterexampleStep>,
}

impl Counterexample {
    /// The steps, one line each, in the form the report prints.
    pub fn lines(&self) -> Vec<String> {
        let events: Vec<String> = self
            .steps
            .iter()
            .map(|step| step.event.to_string())
            .collect();
        let width = events.iter().map(String::len).max().unwrap_or(0);
        let mut lines = vec![format!(
            "{:>4}  {:<width$}  {}",
            "step", "client, operation, slot access; what follows", "bucket after"
        )];
        lines.push(format!("{:>4}  {:<width$}  {}", 0, "(start)", self.initial));
        for (index, (event, step)) in events.iter().zip(&self.steps).enumerate() {
            lines.push(format!(
                "{:>4}  {:<width$}  {}",
                index + 1,
                event,
                step.bucket
            ));
        }
        lines
    }
}

impl fmt::Display for Counterexample {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        for line in self.lines() {
            writeln!(formatter, "{line}")?;
        }
        Ok(())
    }
}

/// Whether one property held, with a counterexample when it did not.
#[derive(Clone, Debug)]
pub struct Verdict {
    /// The property's name.
    pub property: &'static str,
    /// `None` when the property held in every reachable state.
    pub counterexample: Option<Counterexample>,
}

/// The result of checking one model.
#[derive(Clone, Debug)]
pub struct Report {
    /// The model checked.
    pub model: IndexModel,
    /// Distinct states reached.
    pub unique_states: usize,
    /// States generated, counting repeats.
    pub generated_states: usize,
    /// The longest path explored, in steps.
    pub max_depth: usize,
    /// Wall-clock time of the search.
    pub elapsed: Duration,
    /// One verdict per property, in the model's property order.
    pub verdicts: Vec<Verdict>,
}

impl Report {
    /// Whether every property held.
    pub fn all_hold(&self) -> bool {
        self.verdicts
            .iter()
            .all(|verdict| verdict.counterexample.is_none())
    }

    /// Whether the search visited every reachable state. The checker stops early only once
    /// every property has a counterexample, so it did unless all of them do.
    pub fn is_exhaustive(&self) -> bool {
        self.verdicts
            .iter()
            .any(|verdict| verdict.counterexample.is_none())
    }

    /// The counterexample found for `property`, if any.
    pub fn counterexample(&self, property: &str) -> Option<&Counterexample> {
        self.verdicts
            .iter()
            .find(|verdict| verdict.property == property)
            .and_then(|verdict| verdict.counterexample.as_ref())
    }
}

impl fmt::Display for Report {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        let scenario = &self.model.scenario;
        writeln!(
            formatter,
            "scenario {} under the {} protocol ({} slots, retry budget {})",
            scenario.name, self.model.protocol, scenario.slot_count, scenario.retry_budget
        )?;
        writeln!(formatter, "  {}", scenario.summary)?;
        writeln!(formatter, "  start: {}", scenario.initial_bucket())?;
        for (index, script) in scenario.scripts.iter().enumerate() {
            let operations: Vec<String> = script.iter().map(ToString::to_string).collect();
            writeln!(formatter, "  c{}: {}", index + 1, operations.join(", "))?;
        }
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
        for verdict in &self.verdicts {
            if let Some(counterexample) = &verdict.counterexample {
                writeln!(
                    formatter,
                    "\ncounterexample: {} ({} steps; * = the step that invokes the operation, \
                     k1=v11? = a tentative word)",
                    verdict.property,
                    counterexample.steps.len()
                )?;
                write!(formatter, "{counterexample}")?;
            }
        }
        Ok(())
    }
}

/// Explores every reachable state of `model` with `threads` checker threads.
///
/// The search stops early only when every property already has a counterexample.
pub fn check(model: &IndexModel, threads: usize) -> Report {
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
        .map(|property| Verdict {
            property,
            counterexample: discoveries
                .remove(property)
                .map(|path| counterexample(model, property, path.into_actions())),
        })
        .collect();
    Report {
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
    model: &IndexModel,
    property: &'static str,
    actions: Vec<crate::model::ClientStep>,
) -> Counterexample {
    let mut state = model
        .init_states()
        .into_iter()
        .next()
        .expect("the model has one initial state");
    let initial = state.bucket.clone();
    let mut steps = Vec::new();
    for action in actions {
        let (next, event) = model.transition(&state, action);
        steps.push(CounterexampleStep {
            event,
            bucket: next.bucket.clone(),
        });
        state = next;
        if !model.holds(property, &state) {
            break;
        }
    }
    Counterexample { initial, steps }
}
