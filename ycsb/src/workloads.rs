//! The core workload files shipped in `ycsb/workloads/`, built into the binary so that
//! `-P workloada` and `compare` work from anywhere.

/// The text of a shipped workload file by name (`workloada` … `workloadf`).
pub fn builtin(name: &str) -> Option<&'static str> {
    Some(match name {
        "workloada" => include_str!("../workloads/workloada"),
        "workloadb" => include_str!("../workloads/workloadb"),
        "workloadc" => include_str!("../workloads/workloadc"),
        "workloadd" => include_str!("../workloads/workloadd"),
        "workloade" => include_str!("../workloads/workloade"),
        "workloadf" => include_str!("../workloads/workloadf"),
        _ => return None,
    })
}
