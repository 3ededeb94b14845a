//! rdkv-ycsb: a YCSB-style load generator whose output a YCSB user recognises, with rdkv, Redis
//! and in-process drivers.
//!
//! - [`properties`]: workload property files and `-p` overrides.
//! - [`generator`]: zipfian (0.99, scrambled), uniform and latest key choosers.
//! - [`driver`]: the stores.
//! - [`runner`]: load and run phases, throttling, time limits, progress.
//! - [`measurement`]: HdrHistogram latencies, YCSB's text output, JSON.
//! - [`plot`]: throughput-over-time and latency-CDF plots of reports; bars of a comparison.
//! - [`compare`]: rdkv and Redis side by side, in rounds.
//! - [`comparison`]: a comparison's rounds, medians, spread and noise notes; its table and JSON.
//! - [`exit`]: exit codes, and the error of a phase whose operations failed.
//! - [`workloads`]: the shipped core workloads.
#![forbid(unsafe_code)]

pub mod compare;
pub mod comparison;
pub mod driver;
pub mod exit;
pub mod generator;
pub mod measurement;
pub mod plot;
pub mod properties;
pub mod runner;
pub mod workloads;
