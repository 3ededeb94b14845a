//! A budget of log lines: at most one a period for one kind of event, with a count of the ones
//! it left out. Anything an outsider can cause many times a second (a connection that sends
//! garbage before it authenticates, a failed proof) must not turn into as many log lines: a
//! flood of them fills the disk and hides everything else.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use rdkv_fabric::lock;

/// At most one line per `period`; the lines it refuses are counted.
#[derive(Debug)]
pub(crate) struct LogBudget {
    period: Duration,
    last: Mutex<Option<Instant>>,
    left_out: AtomicU64,
}

impl LogBudget {
    /// A budget of one line per `period`.
    pub(crate) const fn new(period: Duration) -> Self {
        Self {
            period,
            last: Mutex::new(None),
            left_out: AtomicU64::new(0),
        }
    }

    /// Whether a line may be written now: `Some(n)` with the `n` lines left out since the last
    /// one written (the caller says so in its line), `None` when this one is left out.
    pub(crate) fn take(&self) -> Option<u64> {
        let mut last = lock(&self.last);
        let now = Instant::now();
        if last.is_some_and(|written| now.duration_since(written) < self.period) {
            self.left_out.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        *last = Some(now);
        Some(self.left_out.swap(0, Ordering::Relaxed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_a_period_and_the_count_of_the_rest() {
        let budget = LogBudget::new(Duration::from_millis(50));
        assert_eq!(budget.take(), Some(0));
        for _ in 0..1_000 {
            assert_eq!(budget.take(), None);
        }
        std::thread::sleep(Duration::from_millis(60));
        assert_eq!(budget.take(), Some(1_000));
        assert_eq!(budget.take(), None);
    }
}
