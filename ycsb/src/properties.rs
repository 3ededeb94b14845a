//! YCSB property files (`key=value`, `#` comments) and `-p key=value` overrides, turned into a
//! [`Workload`].

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use crate::generator::KeyChooser;

/// A property file problem: where and what.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{source_name}:{line}: {message}")]
pub struct PropertyError {
    /// The file, or `-p` for an override.
    pub source_name: String,
    /// The 1-based line (0 for overrides).
    pub line: usize,
    /// What is wrong.
    pub message: String,
}

/// Properties in file order, later values overriding earlier ones.
#[derive(Debug, Clone, Default)]
pub struct Properties {
    values: BTreeMap<String, (String, String, usize)>,
}

impl Properties {
    /// Parses property text.
    ///
    /// # Errors
    /// [`PropertyError`] for a line that is not `key=value`.
    pub fn parse(source_name: &str, text: &str) -> Result<Self, PropertyError> {
        let mut properties = Self::default();
        for (index, raw) in text.lines().enumerate() {
            let line = raw.trim();
            if line.is_empty() || line.starts_with('#') || line.starts_with('!') {
                continue;
            }
            let Some((key, value)) = line.split_once('=').or_else(|| line.split_once(':')) else {
                return Err(PropertyError {
                    source_name: source_name.to_string(),
                    line: index + 1,
                    message: format!("`{line}` is not key=value"),
                });
            };
            let key = key.trim();
            if key.is_empty() {
                return Err(PropertyError {
                    source_name: source_name.to_string(),
                    line: index + 1,
                    message: "a property needs a name before `=`".into(),
                });
            }
            properties.values.insert(
                key.to_string(),
                (value.trim().to_string(), source_name.to_string(), index + 1),
            );
        }
        Ok(properties)
    }

    /// Reads a property file.
    ///
    /// # Errors
    /// [`PropertyError`] when the file cannot be read or a line is malformed.
    pub fn load(path: &Path) -> Result<Self, PropertyError> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|error| PropertyError {
            source_name: name.clone(),
            line: 0,
            message: format!("cannot read the workload file: {error}"),
        })?;
        Self::parse(&name, &text)
    }

    /// Applies a `-p key=value` override.
    ///
    /// # Errors
    /// [`PropertyError`] when it is not `key=value`.
    pub fn set_override(&mut self, assignment: &str) -> Result<(), PropertyError> {
        let Some((key, value)) = assignment.split_once('=') else {
            return Err(PropertyError {
                source_name: "-p".into(),
                line: 0,
                message: format!("`{assignment}` is not key=value"),
            });
        };
        self.values.insert(
            key.trim().to_string(),
            (value.trim().to_string(), "-p".into(), 0),
        );
        Ok(())
    }

    fn raw(&self, key: &str) -> Option<&(String, String, usize)> {
        self.values.get(key)
    }

    fn parsed<T: std::str::FromStr>(
        &self,
        key: &str,
        default: T,
        what: &str,
    ) -> Result<T, PropertyError> {
        match self.raw(key) {
            None => Ok(default),
            Some((value, source_name, line)) => value.parse().map_err(|_| PropertyError {
                source_name: source_name.clone(),
                line: *line,
                message: format!("{key} = `{value}` is not {what}"),
            }),
        }
    }

    /// A string property.
    pub fn string(&self, key: &str, default: &str) -> String {
        self.raw(key)
            .map_or_else(|| default.to_string(), |(value, _, _)| value.clone())
    }

    /// Keys not used by the core workload, for a warning.
    pub fn unknown_keys(&self) -> Vec<String> {
        self.values
            .keys()
            .filter(|key| !KNOWN_KEYS.contains(&key.as_str()))
            .cloned()
            .collect()
    }
}

/// Properties the core workload understands (YCSB names).
const KNOWN_KEYS: &[&str] = &[
    "workload",
    "recordcount",
    "operationcount",
    "fieldcount",
    "fieldlength",
    "readproportion",
    "updateproportion",
    "insertproportion",
    "scanproportion",
    "readmodifywriteproportion",
    "requestdistribution",
    "insertorder",
    "insertstart",
    "insertcount",
    "readallfields",
    "writeallfields",
    "maxscanlength",
    "scanlengthdistribution",
    "fieldlengthdistribution",
    "maxexecutiontime",
];

/// The mix of operations.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Proportions {
    /// READ share.
    pub read: f64,
    /// UPDATE share.
    pub update: f64,
    /// INSERT share.
    pub insert: f64,
    /// SCAN share.
    pub scan: f64,
    /// READ-MODIFY-WRITE share.
    pub read_modify_write: f64,
}

/// A core workload, as YCSB's `CoreWorkload` reads it.
#[derive(Debug, Clone)]
pub struct Workload {
    /// The workload's name (file stem), for output.
    pub name: String,
    /// Records loaded.
    pub record_count: u64,
    /// Operations in the run phase.
    pub operation_count: u64,
    /// Fields per record.
    pub field_count: u64,
    /// Bytes per field.
    pub field_length: u64,
    /// The operation mix.
    pub proportions: Proportions,
    /// How keys are chosen.
    pub request_distribution: String,
    /// `insertorder=hashed` (the default) scrambles key numbers with FNV.
    pub hashed_insert_order: bool,
    /// `insertstart`: the first record number this load inserts (0), so that several loaders
    /// can each insert their own part of `recordcount`, as YCSB's.
    pub insert_start: u64,
    /// `insertcount`: records this load inserts (`recordcount` − `insertstart`).
    pub insert_count: u64,
    /// `maxexecutiontime` (whole seconds; YCSB's 0, the default, means none): a phase stops
    /// after this long even if operations remain.
    pub max_execution_time: Option<Duration>,
}

impl Workload {
    /// Builds a workload from properties.
    ///
    /// # Errors
    /// [`PropertyError`] for a value that is not a number, a proportion outside 0..1, an
    /// all-zero mix, or an unknown distribution.
    pub fn from_properties(name: &str, properties: &Properties) -> Result<Self, PropertyError> {
        let proportions = Proportions::from_properties(name, properties)?;
        let request_distribution = properties.string("requestdistribution", "uniform");
        if let Err(message) = KeyChooser::from_name(&request_distribution) {
            let (_, source_name, line) = properties
                .raw("requestdistribution")
                .cloned()
                .unwrap_or_default();
            return Err(PropertyError {
                source_name,
                line,
                message,
            });
        }
        let insert_order = properties.string("insertorder", "hashed");
        if insert_order != "hashed" && insert_order != "ordered" {
            let (_, source_name, line) = properties.raw("insertorder").cloned().unwrap_or_default();
            return Err(PropertyError {
                source_name,
                line,
                message: format!("insertorder = `{insert_order}`: use hashed or ordered"),
            });
        }
        let (record_count, insert_start, insert_count) = insert_range(properties)?;
        Ok(Self {
            name: name.to_string(),
            record_count,
            insert_start,
            insert_count,
            operation_count: properties.parsed("operationcount", 1000, "a whole number")?,
            field_count: properties.parsed("fieldcount", 10, "a whole number")?,
            field_length: properties.parsed("fieldlength", 100, "a whole number")?,
            proportions,
            request_distribution,
            hashed_insert_order: insert_order == "hashed",
            max_execution_time: match properties.parsed(
                "maxexecutiontime",
                0,
                "a whole number of seconds",
            )? {
                0 => None,
                seconds => Some(Duration::from_secs(seconds)),
            },
        })
    }

    /// A phase's time limit: `--max-execution-time` when given (0 for none), else the
    /// `maxexecutiontime` property.
    pub fn time_limit(&self, flag_seconds: Option<u64>) -> Option<Duration> {
        match flag_seconds {
            Some(0) => None,
            Some(seconds) => Some(Duration::from_secs(seconds)),
            None => self.max_execution_time,
        }
    }

    /// Bytes of one record's value blob (fieldcount × fieldlength).
    pub fn record_size(&self) -> usize {
        (self.field_count * self.field_length) as usize
    }

    /// The key of record number `number`: `user` followed by the (hashed) number, as YCSB.
    /// Written with `itoa` (two digits a step) into a string of the right size: `format!` cost
    /// about 800 instructions a key, and a digit-by-digit loop with a UTF-8 check about 800 a
    /// key as well, a seventh of a GET over `shm` in every store's runs alike.
    pub fn key(&self, number: u64) -> String {
        let number = if self.hashed_insert_order {
            crate::generator::fnv_hash64(number)
        } else {
            number
        };
        let mut digits = itoa::Buffer::new();
        let digits = digits.format(number);
        let mut key = String::with_capacity(KEY_PREFIX.len() + digits.len());
        key.push_str(KEY_PREFIX);
        key.push_str(digits);
        key
    }
}

/// What every key starts with, as YCSB's.
const KEY_PREFIX: &str = "user";

impl Proportions {
    /// The `*proportion` properties: each within 0..1, not all 0.
    fn from_properties(name: &str, properties: &Properties) -> Result<Self, PropertyError> {
        let proportion = |key: &str, default: f64| -> Result<f64, PropertyError> {
            let value: f64 = properties.parsed(key, default, "a number")?;
            if !(0.0..=1.0).contains(&value) {
                let (_, source_name, line) = properties.raw(key).cloned().unwrap_or_default();
                return Err(PropertyError {
                    source_name,
                    line,
                    message: format!("{key} = {value} is outside 0..1"),
                });
            }
            Ok(value)
        };
        let proportions = Self {
            read: proportion("readproportion", 0.95)?,
            update: proportion("updateproportion", 0.05)?,
            insert: proportion("insertproportion", 0.0)?,
            scan: proportion("scanproportion", 0.0)?,
            read_modify_write: proportion("readmodifywriteproportion", 0.0)?,
        };
        let total = proportions.read
            + proportions.update
            + proportions.insert
            + proportions.scan
            + proportions.read_modify_write;
        if total <= 0.0 {
            return Err(PropertyError {
                source_name: name.to_string(),
                line: 0,
                message: "every operation proportion is 0: nothing to run".into(),
            });
        }
        Ok(proportions)
    }
}

/// `recordcount`, `insertstart` and `insertcount` (by default the rest of `recordcount`): the
/// records this loader inserts lie within `recordcount`.
fn insert_range(properties: &Properties) -> Result<(u64, u64, u64), PropertyError> {
    let record_count: u64 = properties.parsed("recordcount", 1000, "a whole number")?;
    let insert_start: u64 = properties.parsed("insertstart", 0, "a whole number")?;
    let insert_count: u64 = properties.parsed(
        "insertcount",
        record_count.saturating_sub(insert_start),
        "a whole number",
    )?;
    if insert_start.saturating_add(insert_count) > record_count {
        let (_, source_name, line) = properties
            .raw("insertcount")
            .or_else(|| properties.raw("insertstart"))
            .cloned()
            .unwrap_or_default();
        return Err(PropertyError {
            source_name,
            line,
            message: format!(
                "insertstart = {insert_start} and insertcount = {insert_count} go past recordcount = {record_count}: each loader inserts its part of recordcount"
            ),
        });
    }
    Ok((record_count, insert_start, insert_count))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_ycsb_workload_file_parses() {
        let text = "# Yahoo! Cloud System Benchmark\nrecordcount=1000\noperationcount=1000\nworkload=site.ycsb.workloads.CoreWorkload\n\nreadallfields=true\nreadproportion=0.5\nupdateproportion=0.5\nscanproportion=0\ninsertproportion=0\nrequestdistribution=zipfian\n";
        let properties = Properties::parse("workloada", text).expect("valid");
        let workload = Workload::from_properties("workloada", &properties).expect("valid");
        assert_eq!(workload.proportions.read, 0.5);
        assert_eq!(workload.record_size(), 1000);
        assert_eq!(workload.request_distribution, "zipfian");
        assert!(properties.unknown_keys().is_empty());
    }

    #[test]
    fn overrides_win() {
        let mut properties = Properties::parse("w", "recordcount=10\n").expect("valid");
        properties
            .set_override("recordcount=99")
            .expect("valid override");
        assert_eq!(
            Workload::from_properties("w", &properties)
                .expect("valid")
                .record_count,
            99
        );
    }

    #[test]
    fn a_line_without_equals_names_its_line() {
        let error =
            Properties::parse("bad.properties", "recordcount=1\nthis is wrong\n").unwrap_err();
        assert_eq!(error.line, 2);
        assert_eq!(
            error.to_string(),
            "bad.properties:2: `this is wrong` is not key=value"
        );
    }

    #[test]
    fn a_non_number_names_the_key_and_line() {
        let properties = Properties::parse("w", "\nrecordcount=many\n").expect("parses");
        let error = Workload::from_properties("w", &properties).unwrap_err();
        assert_eq!(
            error.to_string(),
            "w:2: recordcount = `many` is not a whole number"
        );
    }

    #[test]
    fn proportions_outside_zero_to_one_are_refused() {
        let properties = Properties::parse("w", "readproportion=1.5\n").expect("parses");
        assert!(Workload::from_properties("w", &properties)
            .unwrap_err()
            .message
            .contains("outside 0..1"));
    }

    #[test]
    fn an_unknown_distribution_is_refused() {
        let properties = Properties::parse("w", "requestdistribution=hotspot\n").expect("parses");
        let error = Workload::from_properties("w", &properties).unwrap_err();
        assert_eq!(error.line, 1);
        assert!(error.message.contains("zipfian, uniform or latest"));
    }

    #[test]
    fn a_bad_override_and_an_all_zero_mix_are_refused() {
        let mut properties = Properties::default();
        assert!(properties.set_override("recordcount").is_err());
        properties.set_override("readproportion=0").expect("valid");
        properties
            .set_override("updateproportion=0")
            .expect("valid");
        assert!(Workload::from_properties("w", &properties)
            .unwrap_err()
            .message
            .contains("nothing to run"));
        assert!(Properties::load(Path::new("/nonexistent/workload"))
            .unwrap_err()
            .message
            .contains("cannot read"));
    }

    #[test]
    fn maxexecutiontime_is_read_from_files_and_overrides_and_the_flag_wins() {
        let mut properties = Properties::parse("w", "maxexecutiontime=30\n").expect("parses");
        assert!(properties.unknown_keys().is_empty(), "a known key");
        let from_file = Workload::from_properties("w", &properties).expect("valid");
        assert_eq!(from_file.max_execution_time, Some(Duration::from_secs(30)));
        properties
            .set_override("maxexecutiontime=5")
            .expect("valid override");
        let overridden = Workload::from_properties("w", &properties).expect("valid");
        assert_eq!(overridden.time_limit(None), Some(Duration::from_secs(5)));
        assert_eq!(overridden.time_limit(Some(7)), Some(Duration::from_secs(7)));
        assert_eq!(
            overridden.time_limit(Some(0)),
            None,
            "the flag's 0 lifts it"
        );
        properties
            .set_override("maxexecutiontime=0")
            .expect("valid override");
        let unlimited = Workload::from_properties("w", &properties).expect("valid");
        assert_eq!(unlimited.time_limit(None), None, "YCSB's 0 means no limit");
        assert_eq!(
            Workload::from_properties("w", &Properties::default())
                .expect("valid")
                .max_execution_time,
            None
        );
        properties
            .set_override("maxexecutiontime=1.5")
            .expect("valid override");
        assert_eq!(
            Workload::from_properties("w", &properties)
                .unwrap_err()
                .to_string(),
            "-p:0: maxexecutiontime = `1.5` is not a whole number of seconds"
        );
    }

    #[test]
    fn keys_are_hashed_like_ycsb() {
        let properties = Properties::parse("w", "insertorder=ordered\n").expect("parses");
        let ordered = Workload::from_properties("w", &properties).expect("valid");
        assert_eq!(ordered.key(42), "user42");
        assert_eq!(ordered.key(0), "user0");
        assert_eq!(ordered.key(u64::MAX), format!("user{}", u64::MAX));
        let hashed = Workload::from_properties("w", &Properties::default()).expect("valid");
        assert_eq!(
            hashed.key(42),
            format!("user{}", crate::generator::fnv_hash64(42))
        );
    }
}
