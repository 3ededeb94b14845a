//! Which nodes hold the key under a view, as `client/src/view_following.rs` (`Membership`)
//! routes: the copies a write reaches (the primary first) and the copy a GET reads.

use super::{MemberState, MoveRule, View, RANKING};

/// The key's copies under one view.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Route {
    /// The node a GET reads (`None`: no member can serve it).
    pub read: Option<usize>,
    /// The nodes a write reaches, the primary (which it locks) first.
    pub copies: Vec<usize>,
}

/// The first `count` nodes of `K`'s ranking whose state `accept` takes.
fn ranked(view: &View, accept: fn(MemberState) -> bool, count: usize) -> Vec<usize> {
    RANKING
        .into_iter()
        .filter(|node| accept(view.states[*node]))
        .take(count)
        .collect()
}

/// Appends the nodes of `more` that `copies` lacks.
fn extend(copies: &mut Vec<usize>, more: Vec<usize>) {
    for node in more {
        if !copies.contains(&node) {
            copies.push(node);
        }
    }
}

/// The key's route under the view of `epoch` in `views`, with `replicas` copies per key.
///
/// With two copies or more: the first `replicas` of the ranking over the members serving or
/// leaving, then, while a member joins or leaves, those of the ranking over the members serving
/// or joining (the placement the view is heading for); GETs read the first. With one copy: the
/// first of the ranking over the members not joining (a member down keeps its keys), then the
/// first over those not leaving. Under [`MoveRule::OldHolderBackup`] (and
/// [`MoveRule::SameViewOldHolderBackup`]), a `Promote` view's
/// writes also reach the holder by the view before.
pub fn route(views: &[View], epoch: u8, replicas: usize, rule: MoveRule) -> Route {
    let view = &views[usize::from(epoch)];
    let changing = view
        .states
        .iter()
        .any(|state| matches!(state, MemberState::Joining | MemberState::Leaving));
    if replicas > 1 {
        let mut copies = ranked(
            view,
            |state| matches!(state, MemberState::Serving | MemberState::Leaving),
            replicas,
        );
        if changing {
            let heading = ranked(
                view,
                |state| matches!(state, MemberState::Serving | MemberState::Joining),
                replicas,
            );
            extend(&mut copies, heading);
        }
        return Route {
            read: copies.first().copied(),
            copies,
        };
    }
    let mut copies = ranked(
        view,
        |state| !matches!(state, MemberState::Absent | MemberState::Joining),
        1,
    );
    let read = copies.first().copied();
    extend(
        &mut copies,
        ranked(
            view,
            |state| !matches!(state, MemberState::Absent | MemberState::Leaving),
            1,
        ),
    );
    if rule.old_holder_backup() && view.promoted && epoch > 0 {
        let before = route(views, epoch - 1, replicas, MoveRule::Built);
        extend(&mut copies, before.read.into_iter().collect());
    }
    Route { read, copies }
}

#[cfg(test)]
mod tests {
    use super::*;
    use MemberState::{Absent, Down, Joining, Leaving, Serving};

    fn view(states: [MemberState; 3]) -> View {
        View {
            states,
            promoted: false,
        }
    }

    fn route_of(states: [MemberState; 3], replicas: usize) -> (Option<usize>, Vec<usize>) {
        let found = route(&[view(states)], 0, replicas, MoveRule::Built);
        (found.read, found.copies)
    }

    #[test]
    fn two_copies_reach_the_heading_placement_while_a_member_joins_or_leaves() {
        assert_eq!(
            route_of([Absent, Serving, Serving], 2),
            (Some(1), vec![1, 2])
        );
        assert_eq!(
            route_of([Joining, Serving, Serving], 2),
            (Some(1), vec![1, 2, 0])
        );
        assert_eq!(
            route_of([Serving, Serving, Serving], 2),
            (Some(0), vec![0, 1])
        );
        assert_eq!(
            route_of([Leaving, Serving, Serving], 2),
            (Some(0), vec![0, 1, 2])
        );
        assert_eq!(route_of([Down, Serving, Serving], 2), (Some(1), vec![1, 2]));
    }

    #[test]
    fn one_copy_moves_from_the_holder_to_the_heading_one() {
        assert_eq!(
            route_of([Joining, Serving, Serving], 1),
            (Some(1), vec![1, 0])
        );
        assert_eq!(
            route_of([Leaving, Serving, Serving], 1),
            (Some(0), vec![0, 1])
        );
        assert_eq!(route_of([Down, Serving, Serving], 1), (Some(0), vec![0]));
    }

    #[test]
    fn the_old_holder_stays_a_backup_for_one_epoch_past_a_promotion() {
        let views = [
            view([Joining, Serving, Serving]),
            View {
                states: [Serving, Serving, Serving],
                promoted: true,
            },
        ];
        let found = route(&views, 1, 1, MoveRule::OldHolderBackup);
        assert_eq!((found.read, found.copies), (Some(0), vec![0, 1]));
    }
}
