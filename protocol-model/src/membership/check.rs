//! Running the membership model's exhaustive check and reporting it: the states explored, the
//! time taken, each property's verdict and, for a violated one, the steps that reach it, each
//! with the state after it.

use std::fmt;
use std::time::{Duration, Instant};

use stateright::{Checker, Model};

use super::{
    Client, MemberState, MembershipAction, MembershipModel, MembershipState, Stage, Word,
    PROPERTIES,
};

/// What one check found.
#[derive(Debug, Clone)]
pub struct MembershipReport {
    /// The model checked.
    pub model: MembershipModel,
    /// Distinct states explored.
    pub unique_states: usize,
    /// How long the check took.
    pub elapsed: Duration,
    /// Each property with the actions of its counterexample, if violated.
    pub verdicts: Vec<(&'static str, Option<Vec<MembershipAction>>)>,
}

impl MembershipReport {
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

    /// The steps of `actions` up to the first state that violates `property`.
    pub fn violating_prefix<'a>(
        &self,
        property: &str,
        actions: &'a [MembershipAction],
    ) -> &'a [MembershipAction] {
        let Some(condition) = self
            .model
            .properties()
            .into_iter()
            .find(|candidate| candidate.name == property)
            .map(|found| found.condition)
        else {
            return actions;
        };
        let mut state = self.model.initial();
        for (index, action) in actions.iter().enumerate() {
            if let Some(next) = self.model.next_state(&state, *action) {
                state = next;
            }
            if !condition(&self.model, &state) {
                return &actions[..=index];
            }
        }
        actions
    }

    /// The steps of the counterexample to `property`, if it is violated.
    pub fn counterexample(&self, property: &str) -> Option<&[MembershipAction]> {
        self.verdicts
            .iter()
            .find(|(name, _)| *name == property)
            .and_then(|(_, path)| path.as_deref())
    }
}

/// Explores every reachable state of `model` with `threads` checker threads.
pub fn check(model: MembershipModel, threads: usize) -> MembershipReport {
    let started = Instant::now();
    let checker = model.clone().checker().threads(threads).spawn_bfs().join();
    let mut discoveries = checker.discoveries();
    let verdicts = PROPERTIES
        .into_iter()
        .map(|property| {
            let path = discoveries.remove(property).map(|path| path.into_actions());
            (property, path)
        })
        .collect();
    MembershipReport {
        model,
        unique_states: checker.unique_state_count(),
        elapsed: started.elapsed(),
        verdicts,
    }
}

/// A member state in one letter: `-` absent, `j` joining, `s` serving, `l` leaving, `d` down.
fn letter(state: MemberState) -> char {
    match state {
        MemberState::Absent => '-',
        MemberState::Joining => 'j',
        MemberState::Serving => 's',
        MemberState::Leaving => 'l',
        MemberState::Down => 'd',
    }
}

/// A slot word: its value (`_` absent), its block, `*` when locked.
fn word_text(word: Word) -> String {
    let value = word
        .value
        .map_or("_".to_string(), |value| value.to_string());
    let lock = if word.locked { "*" } else { "" };
    format!("{value}#{}{lock}", word.block)
}

/// A client: its stage, the view its operation runs under and the view it routes by.
fn client_text(client: &Client) -> String {
    let stage = match client.stage {
        Stage::Idle => "idle".to_string(),
        Stage::Finished => "done".to_string(),
        Stage::Check(index, _) => format!("Check({index})"),
        Stage::Steal(_) => "Steal".to_string(),
        other => format!("{other:?}"),
    };
    format!("{stage}@e{}/e{}", client.epoch, client.view)
}

impl fmt::Display for MembershipState {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        let views: Vec<String> = self
            .views
            .iter()
            .map(|view| view.states.iter().copied().map(letter).collect())
            .collect();
        write!(formatter, "views [{}]", views.join(" "))?;
        for (index, node) in self.nodes.iter().enumerate() {
            let flags = match (node.alive, node.stopped) {
                (false, _) => " dead",
                (true, true) => " stopped",
                (true, false) => "",
            };
            write!(
                formatter,
                " | n{} e{} {}{flags}",
                index + 1,
                node.applied,
                word_text(node.word)
            )?;
        }
        let clients: Vec<String> = self.clients.iter().map(client_text).collect();
        write!(
            formatter,
            " | clients {} | task {:?}",
            clients.join(" "),
            self.copier.stage
        )
    }
}

impl fmt::Display for MembershipReport {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        let model = &self.model;
        writeln!(
            formatter,
            "membership {}: rule {}, {} cop{}: {} states in {:.2?}",
            model.name,
            model.rule,
            model.replicas,
            if model.replicas == 1 { "y" } else { "ies" },
            self.unique_states,
            self.elapsed
        )?;
        for (property, path) in &self.verdicts {
            let Some(actions) = path else {
                writeln!(formatter, "  holds:    {property}")?;
                continue;
            };
            let steps = self.violating_prefix(property, actions);
            writeln!(formatter, "  VIOLATED: {property} ({} steps)", steps.len())?;
            let mut state = model.initial();
            writeln!(formatter, "    start: {state}")?;
            for (index, action) in steps.iter().enumerate() {
                if let Some(next) = model.next_state(&state, *action) {
                    state = next;
                }
                writeln!(formatter, "    {:>3} {action:?}: {state}", index + 1)?;
            }
        }
        Ok(())
    }
}
