//! Checks made before pinning memory: RLIMIT_MEMLOCK, MemAvailable and free hugepages.
//!
//! Each check is split into a pure decision function (unit-tested with injected figures) and a
//! reader of the live system figures, so the error paths are tested on any machine.

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// The capability bit that lifts RLIMIT_MEMLOCK (linux/capability.h).
const CAP_IPC_LOCK: u32 = 14;

/// The size of one huge page: rdkv uses 2 MiB pages only.
pub const HUGEPAGE_SIZE: u64 = 2 * 1024 * 1024;

/// How the memory layer backs a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum HugepagePolicy {
    /// 2 MiB hugetlb pages if enough are free, else transparent hugepages, else 4 KiB pages.
    #[default]
    Auto,
    /// 2 MiB hugetlb pages, or fail with an error that says how to reserve them.
    Require,
    /// 4 KiB pages only.
    Off,
}

impl std::str::FromStr for HugepagePolicy {
    type Err = String;
    fn from_str(text: &str) -> std::result::Result<Self, String> {
        match text {
            "auto" => Ok(Self::Auto),
            "require" => Ok(Self::Require),
            "off" => Ok(Self::Off),
            other => Err(format!(
                "unknown hugepage policy `{other}`: expected auto, require or off"
            )),
        }
    }
}

/// Limits applied before pinning.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PinLimits {
    /// The largest share of MemAvailable that one allocation may pin, from 0.0 to 1.0.
    pub max_pinned_share: f64,
}

impl Default for PinLimits {
    fn default() -> Self {
        Self {
            max_pinned_share: 0.5,
        }
    }
}

/// The figures a memlock decision needs.
#[derive(Debug, Clone, Copy)]
pub struct MemlockFigures {
    /// Soft RLIMIT_MEMLOCK in bytes (`u64::MAX` for unlimited).
    pub soft_limit: u64,
    /// Hard RLIMIT_MEMLOCK in bytes.
    pub hard_limit: u64,
    /// Bytes already locked by this process.
    pub locked_bytes: u64,
    /// Whether the process holds CAP_IPC_LOCK, which lifts the limit.
    pub has_ipc_lock_capability: bool,
}

/// What the memlock check decided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemlockDecision {
    /// The current soft limit is enough (or the capability lifts it).
    Fits,
    /// Raising the soft limit to the hard limit makes it fit.
    RaiseSoftToHard,
}

/// Decides whether `requested` more bytes can be locked.
///
/// # Errors
/// [`Error::MemlockLimit`] when even the hard limit is too low.
pub fn decide_memlock(requested: u64, figures: MemlockFigures) -> Result<MemlockDecision> {
    if figures.has_ipc_lock_capability {
        return Ok(MemlockDecision::Fits);
    }
    let needed = figures.locked_bytes.saturating_add(requested);
    if needed <= figures.soft_limit {
        return Ok(MemlockDecision::Fits);
    }
    if needed <= figures.hard_limit {
        return Ok(MemlockDecision::RaiseSoftToHard);
    }
    Err(Error::MemlockLimit {
        requested_bytes: requested,
        limit_bytes: figures.hard_limit,
        locked_bytes: figures.locked_bytes,
    })
}

/// Decides whether `requested` bytes fit in the allowed share of MemAvailable.
///
/// # Errors
/// [`Error::InsufficientMemory`] when they do not.
pub fn decide_available_memory(requested: u64, available: u64, limits: PinLimits) -> Result<()> {
    let share = limits.max_pinned_share.clamp(0.0, 1.0);
    let allowed = (available as f64 * share) as u64;
    if requested <= allowed {
        return Ok(());
    }
    Err(Error::InsufficientMemory {
        requested_bytes: requested,
        available_bytes: available,
        max_share_percent: (share * 100.0).round() as u32,
        allowed_bytes: allowed,
    })
}

/// Decides whether enough hugepages are free for `requested` bytes.
///
/// # Errors
/// [`Error::HugepagesUnavailable`] when they are not.
pub fn decide_hugepages(requested: u64, free_pages: u64) -> Result<()> {
    let needed_pages = requested.div_ceil(HUGEPAGE_SIZE);
    if needed_pages <= free_pages {
        return Ok(());
    }
    Err(Error::HugepagesUnavailable {
        needed_pages,
        free_pages,
    })
}

/// Reads one `Key: value kB` figure from /proc/meminfo (or a count for the HugePages lines).
fn meminfo_field(text: &str, key: &str) -> Option<u64> {
    let line = text.lines().find(|line| line.starts_with(key))?;
    let rest = line[key.len()..].trim_start_matches(':').trim();
    let mut parts = rest.split_whitespace();
    let number: u64 = parts.next()?.parse().ok()?;
    Some(match parts.next() {
        Some("kB") => number * 1024,
        _ => number,
    })
}

/// The live figures from /proc: MemAvailable in bytes and HugePages_Free in pages.
pub fn read_meminfo() -> (u64, u64) {
    let text = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let available = meminfo_field(&text, "MemAvailable").unwrap_or(0);
    let free_hugepages = meminfo_field(&text, "HugePages_Free").unwrap_or(0);
    (available, free_hugepages)
}

/// The live memlock figures of this process.
pub fn read_memlock_figures() -> MemlockFigures {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the valid, exclusively borrowed `limit`.
    let status = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) };
    let (soft_limit, hard_limit) = if status == 0 {
        (limit.rlim_cur, limit.rlim_max)
    } else {
        (0, 0)
    };
    let status_text = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let locked_bytes = meminfo_field(&status_text, "VmLck").unwrap_or(0);
    let has_ipc_lock_capability = status_text
        .lines()
        .find(|line| line.starts_with("CapEff:"))
        .and_then(|line| u64::from_str_radix(line["CapEff:".len()..].trim(), 16).ok())
        .is_some_and(|mask| mask & (1 << CAP_IPC_LOCK) != 0);
    MemlockFigures {
        soft_limit,
        hard_limit,
        locked_bytes,
        has_ipc_lock_capability,
    }
}

/// Raises the soft RLIMIT_MEMLOCK to the hard limit.
pub fn raise_memlock_soft_limit() -> std::io::Result<()> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the valid, exclusively borrowed `limit`.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    limit.rlim_cur = limit.rlim_max;
    // SAFETY: setrlimit reads one valid rlimit; raising soft to hard needs no privilege.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &limit) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1024 * 1024;

    fn figures(soft: u64, hard: u64, locked: u64) -> MemlockFigures {
        MemlockFigures {
            soft_limit: soft,
            hard_limit: hard,
            locked_bytes: locked,
            has_ipc_lock_capability: false,
        }
    }

    #[test]
    fn memlock_fits_under_soft_limit() {
        let decision = decide_memlock(4 * MIB, figures(8 * MIB, 8 * MIB, 0)).expect("fits");
        assert_eq!(decision, MemlockDecision::Fits);
    }

    #[test]
    fn memlock_raises_soft_to_hard_when_that_is_enough() {
        let decision = decide_memlock(16 * MIB, figures(8 * MIB, 64 * MIB, 0)).expect("fits");
        assert_eq!(decision, MemlockDecision::RaiseSoftToHard);
    }

    #[test]
    fn memlock_error_names_the_fix_and_this_machines_default() {
        let error = decide_memlock(64 * MIB, figures(8 * MIB, 8 * MIB, MIB)).unwrap_err();
        let message = error.to_string();
        assert!(matches!(
            error,
            Error::MemlockLimit {
                requested_bytes,
                limit_bytes,
                locked_bytes
            } if requested_bytes == 64 * MIB && limit_bytes == 8 * MIB && locked_bytes == MIB
        ));
        assert!(message.contains("ulimit -l"), "{message}");
        assert!(message.contains("limits.conf"), "{message}");
        assert!(message.contains("8 MiB"), "{message}");
    }

    #[test]
    fn memlock_counts_what_is_already_locked() {
        assert!(decide_memlock(5 * MIB, figures(8 * MIB, 8 * MIB, 4 * MIB)).is_err());
    }

    #[test]
    fn ipc_lock_capability_lifts_the_limit() {
        let mut with_capability = figures(8 * MIB, 8 * MIB, 0);
        with_capability.has_ipc_lock_capability = true;
        assert_eq!(
            decide_memlock(1024 * MIB, with_capability).expect("capability"),
            MemlockDecision::Fits
        );
    }

    #[test]
    fn available_memory_share_is_enforced() {
        let limits = PinLimits::default();
        decide_available_memory(400 * MIB, 1000 * MIB, limits).expect("40% fits");
        let error = decide_available_memory(600 * MIB, 1000 * MIB, limits).unwrap_err();
        assert!(matches!(
            error,
            Error::InsufficientMemory {
                max_share_percent: 50,
                allowed_bytes,
                ..
            } if allowed_bytes == 500 * MIB
        ));
        assert!(error.to_string().contains("max_pinned_share"));
    }

    #[test]
    fn hugepage_shortage_names_nr_hugepages() {
        decide_hugepages(4 * MIB, 2).expect("two pages fit 4 MiB");
        let error = decide_hugepages(5 * MIB, 2).unwrap_err();
        assert!(matches!(
            error,
            Error::HugepagesUnavailable {
                needed_pages: 3,
                free_pages: 2
            }
        ));
        assert!(error.to_string().contains("nr_hugepages"));
    }

    #[test]
    fn meminfo_fields_parse_with_and_without_units() {
        let text =
            "MemTotal:       24000000 kB\nMemAvailable:   1000 kB\nHugePages_Free:        7\n";
        assert_eq!(meminfo_field(text, "MemAvailable"), Some(1000 * 1024));
        assert_eq!(meminfo_field(text, "HugePages_Free"), Some(7));
        assert_eq!(meminfo_field(text, "Missing"), None);
    }

    #[test]
    fn hugepage_policy_parses_and_rejects_unknown_words() {
        assert_eq!(
            "require".parse::<HugepagePolicy>(),
            Ok(HugepagePolicy::Require)
        );
        assert!("sometimes"
            .parse::<HugepagePolicy>()
            .unwrap_err()
            .contains("auto, require or off"));
    }
}
