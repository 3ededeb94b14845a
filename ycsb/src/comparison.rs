//! The figures of `rdkv-ycsb compare`: each store's rounds per workload, their median and
//! spread, the table with its noise notes, and the JSON file (`compare --json`) that `plot` reads.
//!
//! The JSON file:
//!
//! ```text
//! { "comparison": { "records", "record_size", "seconds", "threads", "nodes", "replicas",
//!                   "heap_size", "rounds" },
//!   "workloads": [ { "workload": "C",
//!                    "stores": { "rdkv shm": { "median_throughput", "min_throughput",
//!                                              "max_throughput", "vs_better_redis", "vs_map",
//!                                              "rounds": [report, …] },
//!                                … } } ] }
//! ```
//!
//! Store keys are the names the table prints (`"rdkv shm"`, …, `"map"`), in the order the stores
//! ran; each round is a report as `run --json` writes it. The median, minimum and maximum are
//! derived from the rounds, and so are the ratios of the median to the better Redis's and to the
//! map's (`null` when no Redis, or no map, ran); all are recomputed from the rounds when the file
//! is read.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::compare::Store;
use crate::measurement::{OperationKind, Report};

/// Rounds of one store that disagree by more than this (max / min − 1) get a noise note.
pub const NOISE_THRESHOLD: f64 = 0.2;

/// The settings a comparison ran with, as the table's first line states them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Settings {
    /// Records loaded into each store.
    pub records: u64,
    /// Bytes of each record's value.
    pub record_size: usize,
    /// Seconds each workload ran, per store and round.
    pub seconds: f64,
    /// Concurrent tasks per store.
    pub threads: usize,
    /// rdkv nodes.
    pub nodes: u32,
    /// Copies of each key.
    pub replicas: usize,
    /// Each rdkv node's heap, in bytes.
    pub heap_size: u64,
    /// Rounds: each ran every store in turn, every workload once per store.
    pub rounds: usize,
}

/// A whole comparison: what `compare` prints and what `compare --json` writes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Comparison {
    /// The settings; its key, `comparison`, also tells `plot` what the file is.
    #[serde(rename = "comparison")]
    pub settings: Settings,
    /// One entry per workload, in the order they ran.
    pub workloads: Vec<WorkloadFigures>,
}

/// One workload's figures, per store.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WorkloadFigures {
    /// The workload letter.
    pub workload: String,
    /// Each store's rounds, in the order the stores ran (a JSON object keyed by store name).
    #[serde(with = "by_store_name")]
    pub stores: Vec<StoreFigures>,
}

/// One store's rounds of one workload.
#[derive(Debug, Clone, PartialEq)]
pub struct StoreFigures {
    /// The store.
    pub store: Store,
    /// One report per round, in the order they ran.
    pub rounds: Vec<Report>,
}

impl StoreFigures {
    /// Each round's operations per second.
    pub fn throughputs(&self) -> Vec<f64> {
        self.rounds.iter().map(|report| report.throughput).collect()
    }

    /// The median of the rounds' operations per second (0 without rounds).
    pub fn median_throughput(&self) -> f64 {
        median(self.throughputs()).unwrap_or(0.0)
    }

    /// The slowest round's operations per second (0 without rounds).
    pub fn min_throughput(&self) -> f64 {
        self.throughputs()
            .into_iter()
            .reduce(f64::min)
            .unwrap_or(0.0)
    }

    /// The fastest round's operations per second (0 without rounds).
    pub fn max_throughput(&self) -> f64 {
        self.throughputs()
            .into_iter()
            .reduce(f64::max)
            .unwrap_or(0.0)
    }

    /// How far the rounds disagree: max / min − 1 (infinite when a round measured nothing);
    /// `None` for fewer than two rounds.
    pub fn spread(&self) -> Option<f64> {
        if self.rounds.len() < 2 {
            return None;
        }
        let (min, max) = (self.min_throughput(), self.max_throughput());
        Some(if min > 0.0 {
            max / min - 1.0
        } else {
            f64::INFINITY
        })
    }

    /// The noise note for these rounds of `workload`, when they disagree by more than
    /// [`NOISE_THRESHOLD`] in whole percent, as printed (20.4% is 20%: no note).
    pub fn noise_note(&self, workload: &str) -> Option<String> {
        let spread = self
            .spread()
            .filter(|spread| (spread * 100.0).round() > NOISE_THRESHOLD * 100.0)?;
        let by = if spread.is_finite() {
            format!(" by {:.0}%", spread * 100.0)
        } else {
            String::new()
        };
        Some(format!(
            "{} in {workload}: rounds disagree{by} ({:.0} to {:.0} ops/s); rerun with more --seconds or --rounds, or on a quieter machine",
            self.store.name(),
            self.min_throughput(),
            self.max_throughput(),
        ))
    }

    /// The median over the rounds of `figure`, skipping rounds without it.
    fn median_of(&self, figure: impl Fn(&Report) -> Option<f64>) -> Option<f64> {
        median(self.rounds.iter().filter_map(figure).collect())
    }
}

/// The median of `values` (the mean of the middle two for an even count); `None` if empty.
pub fn median(mut values: Vec<f64>) -> Option<f64> {
    values.sort_by(f64::total_cmp);
    let middle = values.len() / 2;
    match values.len() {
        0 => None,
        length if length % 2 == 1 => Some(values[middle]),
        _ => Some((values[middle - 1] + values[middle]) / 2.0),
    }
}

impl Comparison {
    /// A comparison of `stores` over `workloads` (letters), with no rounds yet.
    pub fn new(settings: Settings, workloads: &[String], stores: &[Store]) -> Self {
        let workloads = workloads
            .iter()
            .map(|letter| WorkloadFigures {
                workload: letter.to_uppercase(),
                stores: stores
                    .iter()
                    .map(|&store| StoreFigures {
                        store,
                        rounds: Vec::new(),
                    })
                    .collect(),
            })
            .collect();
        Self {
            settings,
            workloads,
        }
    }

    /// Adds `report` as the next round of `store` in the workload at `index`.
    ///
    /// # Panics
    /// If there is no such workload or `store` was not given to [`Comparison::new`].
    pub fn record(&mut self, index: usize, store: Store, report: Report) {
        self.workloads[index]
            .stores
            .iter_mut()
            .find(|figures| figures.store == store)
            .expect("every compared store has figures")
            .rounds
            .push(report);
    }

    /// Every report of every round.
    pub fn reports(&self) -> impl Iterator<Item = &Report> {
        self.workloads
            .iter()
            .flat_map(|workload| &workload.stores)
            .flat_map(|figures| &figures.rounds)
    }

    /// One line per store and workload whose rounds disagree by more than
    /// [`NOISE_THRESHOLD`]; none for a single round.
    pub fn noise_notes(&self) -> Vec<String> {
        self.workloads
            .iter()
            .flat_map(|workload| {
                workload
                    .stores
                    .iter()
                    .filter_map(|figures| figures.noise_note(&workload.workload))
            })
            .collect()
    }

    /// The table: one line per workload and store, each against the better Redis and against
    /// the map (the harness's own ceiling), then the noise notes. With several rounds each figure is the median of the rounds, and a last
    /// column gives the rounds' range of ops/s.
    pub fn table(&self) -> String {
        let settings = &self.settings;
        let mut out = format!(
            "{} records of {} bytes, {} tasks per store, {} s per workload; rdkv on {} node(s), {} cop{} of each key ({} heap each; shm: this process is on the nodes' host), Redis with one multiplexed connection{}\n\n",
            settings.records,
            settings.record_size,
            settings.threads,
            settings.seconds,
            settings.nodes,
            settings.replicas.max(1),
            if settings.replicas > 1 { "ies" } else { "y" },
            rdkv_cluster_file::units::format_bytes(settings.heap_size),
            if settings.rounds > 1 {
                format!("; medians of {} rounds, each running every store in turn", settings.rounds)
            } else {
                String::new()
            },
        );
        let several = settings.rounds > 1;
        out.push_str("| workload | store | ops/s | vs better Redis | vs map | READ p50 µs | READ p99 µs | round trips/op | round trips/READ | client CPU µs/op | server CPU µs/op | server CPU % of a core | errors |");
        out.push_str(if several {
            " rounds' ops/s (spread) |\n"
        } else {
            "\n"
        });
        out.push_str("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
        out.push_str(if several { "---:|\n" } else { "\n" });
        for workload in &self.workloads {
            let references = References::of(&workload.stores);
            for figures in workload
                .stores
                .iter()
                .filter(|figures| !figures.rounds.is_empty())
            {
                out.push_str(&table_line(
                    &workload.workload,
                    figures,
                    references,
                    several,
                ));
            }
        }
        let notes = self.noise_notes();
        if !notes.is_empty() {
            out.push('\n');
            out.push_str(&notes.join("\n"));
            out.push('\n');
        }
        out
    }
}

impl WorkloadFigures {
    /// The figures of `store`, if it ran.
    pub fn figures(&self, store: Store) -> Option<&StoreFigures> {
        self.stores
            .iter()
            .find(|figures| figures.store == store && !figures.rounds.is_empty())
    }

    /// The better Redis median throughput (TCP or Unix socket), if either ran.
    pub fn best_redis(&self) -> Option<f64> {
        References::of(&self.stores).best_redis
    }
}

/// What every store of a workload is measured against: the median ops/s of the better Redis and
/// of the map, where they ran.
#[derive(Debug, Clone, Copy)]
struct References {
    /// The better Redis (TCP or Unix socket).
    best_redis: Option<f64>,
    /// The map: the harness's own ceiling.
    map: Option<f64>,
}

impl References {
    /// The references among one workload's `stores`.
    fn of(stores: &[StoreFigures]) -> Self {
        let ran = || stores.iter().filter(|figures| !figures.rounds.is_empty());
        Self {
            best_redis: ran()
                .filter(|figures| figures.store.is_redis())
                .map(StoreFigures::median_throughput)
                .reduce(f64::max),
            map: ran()
                .find(|figures| figures.store == Store::Map)
                .map(StoreFigures::median_throughput),
        }
    }

    /// `throughput` against the better Redis and against the map.
    fn ratios(self, throughput: f64) -> (Option<f64>, Option<f64>) {
        let ratio = |reference: Option<f64>| reference.map(|ops| throughput / ops.max(1e-9));
        (ratio(self.best_redis), ratio(self.map))
    }
}

/// The READ (or first measured) kind's p50 and p99 latency, in µs.
fn read_percentiles(report: &Report) -> Option<(f64, f64)> {
    report
        .kind(OperationKind::Read)
        .or_else(|| report.kinds.first())
        .map(|kind| (kind.p50_us as f64, kind.p99_us as f64))
}

/// One line of the table: `figures` of `workload`, its medians over the rounds.
fn table_line(
    workload: &str,
    figures: &StoreFigures,
    references: References,
    several: bool,
) -> String {
    let shown = |value: Option<f64>, decimals: usize| {
        value.map_or_else(|| "-".to_string(), |value| format!("{value:.decimals$}"))
    };
    let throughput = figures.median_throughput();
    let percentile = |pick: fn((f64, f64)) -> f64| {
        figures
            .median_of(|report| read_percentiles(report).map(pick))
            .unwrap_or(0.0)
    };
    let rdkv = |pick: fn(&crate::measurement::RdkvFigures) -> f64| {
        let value = figures.median_of(|report| report.rdkv.as_ref().map(pick));
        shown(value.filter(|_| !figures.store.is_redis()), 2)
    };
    let server_share = figures.median_of(|report| {
        report
            .server_cpu_us_per_operation
            .map(|us| us * report.throughput / 1e6 * 100.0)
    });
    let ratio =
        |ratio: Option<f64>| ratio.map_or_else(|| "-".to_string(), |ratio| format!("{ratio:.2}×"));
    let (against_redis, against_map) = references.ratios(throughput);
    let mut line = format!(
        "| {workload} | {} | {throughput:.0} | {} | {} | {:.0} | {:.0} | {} | {} | {} | {} | {} | {} |",
        figures.store.name(),
        ratio(against_redis),
        ratio(against_map),
        percentile(|(p50, _)| p50),
        percentile(|(_, p99)| p99),
        rdkv(|rdkv| rdkv.round_trips_per_operation),
        rdkv(|rdkv| rdkv.round_trips_per_read),
        shown(figures.median_of(|report| report.client_cpu_us_per_operation), 1),
        shown(figures.median_of(|report| report.server_cpu_us_per_operation), 1),
        shown(server_share, 1),
        figures.rounds.iter().map(Report::errors).sum::<u64>(),
    );
    if several {
        let spread = figures.spread().map_or_else(
            || "-".to_string(),
            |spread| format!("{:.0}%", spread * 100.0),
        );
        line.push_str(&format!(
            " {:.0}–{:.0} ({spread}) |",
            figures.min_throughput(),
            figures.max_throughput()
        ));
    }
    line.push('\n');
    line
}

/// [`WorkloadFigures::stores`] as a JSON object keyed by the table's store names, in the order
/// the stores ran.
mod by_store_name {
    use serde::de::{Error as _, MapAccess, Visitor};
    use serde::ser::SerializeMap;
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use super::{fmt, References, Report, Store, StoreFigures};

    /// A store's entry as written: the figures derived from its rounds, then the rounds.
    #[derive(Serialize)]
    struct WrittenEntry<'a> {
        median_throughput: f64,
        min_throughput: f64,
        max_throughput: f64,
        /// The median against the better Redis's, as the table's `vs better Redis`.
        vs_better_redis: Option<f64>,
        /// The median against the map's, as the table's `vs map`.
        vs_map: Option<f64>,
        rounds: &'a [Report],
    }

    /// A store's entry as read: only the rounds (the rest is derived from them).
    #[derive(Deserialize)]
    struct ReadEntry {
        rounds: Vec<Report>,
    }

    pub fn serialize<S: Serializer>(
        stores: &[StoreFigures],
        serializer: S,
    ) -> Result<S::Ok, S::Error> {
        let references = References::of(stores);
        let mut map = serializer.serialize_map(Some(stores.len()))?;
        for figures in stores {
            let (vs_better_redis, vs_map) = references.ratios(figures.median_throughput());
            let entry = WrittenEntry {
                median_throughput: figures.median_throughput(),
                min_throughput: figures.min_throughput(),
                max_throughput: figures.max_throughput(),
                vs_better_redis: vs_better_redis.filter(|_| !figures.rounds.is_empty()),
                vs_map: vs_map.filter(|_| !figures.rounds.is_empty()),
                rounds: &figures.rounds,
            };
            map.serialize_entry(figures.store.name(), &entry)?;
        }
        map.end()
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<Vec<StoreFigures>, D::Error> {
        deserializer.deserialize_map(StoresVisitor)
    }

    /// Reads the object in document order, which is the order the stores ran.
    struct StoresVisitor;

    impl<'de> Visitor<'de> for StoresVisitor {
        type Value = Vec<StoreFigures>;

        fn expecting(&self, formatter: &mut fmt::Formatter) -> fmt::Result {
            formatter.write_str("an object keyed by store name (\"rdkv shm\", \"Redis TCP\", …)")
        }

        fn visit_map<Access: MapAccess<'de>>(
            self,
            mut map: Access,
        ) -> Result<Self::Value, Access::Error> {
            let mut stores = Vec::new();
            while let Some(name) = map.next_key::<String>()? {
                let store = Store::from_name(&name).ok_or_else(|| {
                    Access::Error::custom(format!(
                        "unknown store `{name}` (the stores: {})",
                        Store::ALL.map(Store::name).join(", ")
                    ))
                })?;
                let entry: ReadEntry = map.next_value()?;
                if entry.rounds.is_empty() {
                    return Err(Access::Error::custom(format!("`{name}` has no rounds")));
                }
                stores.push(StoreFigures {
                    store,
                    rounds: entry.rounds,
                });
            }
            Ok(stores)
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::measurement::KindSummary;

    /// A run report of `store` that measured `throughput` ops/s.
    pub(crate) fn report(store: Store, throughput: f64) -> Report {
        Report {
            phase: "run".to_string(),
            workload: "workloadc".to_string(),
            driver: store.name().to_string(),
            threads: 4,
            runtime_ms: 1000,
            throughput,
            operations: throughput as u64,
            kinds: vec![KindSummary {
                kind: OperationKind::Read,
                operations: throughput as u64,
                average_us: 50.0,
                min_us: 10,
                max_us: 900,
                p50_us: 40,
                p95_us: 80,
                p99_us: 120,
                outcomes: [("OK".to_string(), throughput as u64)].into(),
                cdf: vec![(10, 0.0), (40, 0.5), (900, 1.0)],
            }],
            rdkv: None,
            timeseries: vec![(1.0, throughput)],
            first_error: None,
            client_cpu_us_per_operation: Some(3.0),
            server_cpu_us_per_operation: None,
        }
    }

    /// A comparison of workload C whose stores measured these ops/s, one figure per round.
    pub(crate) fn comparison(rounds: &[(Store, &[f64])]) -> Comparison {
        let stores: Vec<Store> = rounds.iter().map(|(store, _)| *store).collect();
        let settings = Settings {
            records: 1000,
            record_size: 100,
            seconds: 1.0,
            threads: 4,
            nodes: 1,
            replicas: 1,
            heap_size: 1 << 24,
            rounds: rounds
                .iter()
                .map(|(_, figures)| figures.len())
                .max()
                .unwrap_or(1),
        };
        let mut comparison = Comparison::new(settings, &["c".to_string()], &stores);
        for (store, figures) in rounds {
            for &throughput in *figures {
                comparison.record(0, *store, report(*store, throughput));
            }
        }
        comparison
    }

    #[test]
    fn the_median_of_even_and_odd_counts() {
        assert_eq!(median(vec![]), None);
        assert_eq!(median(vec![3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(vec![4.0, 1.0, 2.0, 3.0]), Some(2.5));
    }

    #[test]
    fn the_json_is_keyed_by_the_table_names_and_reads_back() {
        let written = comparison(&[
            (Store::RdkvShm, &[100.0, 140.0, 120.0]),
            (Store::RedisTcp, &[200.0, 210.0, 205.0]),
            (Store::Memory, &[400.0, 380.0, 390.0]),
        ]);
        let text = serde_json::to_string_pretty(&written).expect("serialize");
        let value: serde_json::Value = serde_json::from_str(&text).expect("JSON");
        let stores = &value["workloads"][0]["stores"];
        // In the text: a `Value` sorts its keys.
        let at = |name: &str| text.find(&format!("\"{name}\": {{")).expect(name);
        assert!(
            at("rdkv shm") < at("Redis TCP") && at("Redis TCP") < at("memory (ceiling)"),
            "keyed by the table's names, in run order: {text}"
        );
        assert_eq!(stores["rdkv shm"]["median_throughput"], 120.0);
        assert_eq!(stores["rdkv shm"]["min_throughput"], 100.0);
        assert_eq!(stores["rdkv shm"]["max_throughput"], 140.0);
        assert_eq!(
            stores["rdkv shm"]["rounds"].as_array().map(Vec::len),
            Some(3)
        );
        assert_eq!(value["comparison"]["rounds"], 3);
        let read: Comparison = serde_json::from_str(&text).expect("read back");
        assert_eq!(read, written);
    }

    #[test]
    fn an_unknown_store_or_no_rounds_is_refused() {
        let unknown = r#"{"comparison": {"records": 1, "record_size": 1, "seconds": 1.0, "threads": 1, "nodes": 1, "replicas": 1, "heap_size": 1, "rounds": 1},
            "workloads": [{"workload": "C", "stores": {"rdkv": {"rounds": []}}}]}"#;
        let error = serde_json::from_str::<Comparison>(unknown).unwrap_err();
        assert!(
            error.to_string().contains("unknown store `rdkv`"),
            "{error}"
        );
        let empty = unknown.replace("\"rdkv\"", "\"rdkv soft\"");
        let error = serde_json::from_str::<Comparison>(&empty).unwrap_err();
        assert!(error.to_string().contains("has no rounds"), "{error}");
    }

    #[test]
    fn rounds_that_disagree_by_more_than_a_fifth_get_a_note() {
        let compared = comparison(&[
            (Store::RdkvShm, &[100.0, 135.0]),
            (Store::RdkvSoft, &[100.0, 120.4]),
            (Store::Memory, &[0.0, 50.0]),
        ]);
        let notes = compared.noise_notes();
        assert_eq!(notes.len(), 2, "{notes:?}");
        assert_eq!(
            notes[0],
            "rdkv shm in C: rounds disagree by 35% (100 to 135 ops/s); rerun with more --seconds or --rounds, or on a quieter machine"
        );
        assert!(notes[1].starts_with("memory (ceiling) in C: rounds disagree (0 to 50 ops/s)"));
        let table = compared.table();
        assert!(table.contains("medians of 2 rounds"), "{table}");
        assert!(table.contains("| C | rdkv shm | 118 |"), "{table}");
        assert!(table.contains("| 100–135 (35%) |"), "{table}");
        assert!(table.trim_end().ends_with(&notes[1]), "{table}");
    }

    #[test]
    fn one_round_prints_the_table_without_spread_or_notes() {
        let compared = comparison(&[(Store::RdkvSoft, &[100.0]), (Store::RedisTcp, &[400.0])]);
        assert!(compared.noise_notes().is_empty());
        let table = compared.table();
        assert!(!table.contains("rounds"), "{table}");
        let soft = table
            .lines()
            .find(|line| line.starts_with("| C | rdkv soft |"))
            .expect("a C line for rdkv soft");
        // .ci/run reads these cells: the store in 2, round trips per READ in 9.
        let cells: Vec<&str> = soft.split('|').map(str::trim).collect();
        assert_eq!(cells.len(), 15, "{soft}");
        assert_eq!(&cells[2..6], ["rdkv soft", "100", "0.25×", "-"]);
    }

    #[test]
    fn every_line_is_measured_against_the_map_and_so_is_its_json() {
        let compared = comparison(&[
            (Store::RdkvShm, &[300.0]),
            (Store::RedisTcp, &[200.0]),
            (Store::RedisUnix, &[250.0]),
            (Store::Map, &[1000.0]),
        ]);
        let table = compared.table();
        assert!(
            table.contains("| ops/s | vs better Redis | vs map |"),
            "{table}"
        );
        let ratios = |store: &str| {
            let line = table
                .lines()
                .find(|line| line.starts_with(&format!("| C | {store} |")))
                .unwrap_or_else(|| panic!("a C line for {store}: {table}"));
            let cells: Vec<&str> = line.split('|').map(str::trim).collect();
            (cells[4].to_string(), cells[5].to_string())
        };
        assert_eq!(ratios("rdkv shm"), ("1.20×".into(), "0.30×".into()));
        assert_eq!(ratios("Redis TCP"), ("0.80×".into(), "0.20×".into()));
        assert_eq!(ratios("map"), ("4.00×".into(), "1.00×".into()));

        let value = serde_json::to_value(&compared).expect("JSON");
        let stores = &value["workloads"][0]["stores"];
        assert_eq!(stores["map"]["median_throughput"], 1000.0);
        assert_eq!(stores["map"]["vs_map"], 1.0);
        assert_eq!(stores["rdkv shm"]["vs_map"], 0.3);
        assert_eq!(stores["rdkv shm"]["vs_better_redis"], 1.2);
        // Without a map (or a Redis) the ratio to it is null, in the JSON as in the table.
        let alone = serde_json::to_value(comparison(&[(Store::RdkvSoft, &[100.0])])).expect("JSON");
        let soft = &alone["workloads"][0]["stores"]["rdkv soft"];
        assert!(
            soft["vs_map"].is_null() && soft["vs_better_redis"].is_null(),
            "{soft}"
        );
    }
}
