//! The provider seam's shape, checked on the source: the model imports no provider, the only
//! module naming every provider is the dispatch point, and the verbs cargo feature's `cfg`
//! stays inside the verbs provider and the dispatch (at most 3 uses anywhere else in the
//! crate).
//! `docs/architecture.md` ("The provider seam") points here.

use std::fs;
use std::path::{Path, PathBuf};

/// The crate's root directory.
fn crate_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.rs` file under `directory`, recursively, sorted.
fn rust_files(directory: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut pending = vec![directory.to_path_buf()];
    while let Some(next) = pending.pop() {
        let entries = fs::read_dir(&next)
            .unwrap_or_else(|error| panic!("cannot list {}: {error}", next.display()));
        for entry in entries {
            let path = entry.expect("a directory entry").path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|extension| extension == "rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// The model's files: everything in `src/` except `src/provider/` (the crate root declares the
/// provider module, and is checked too).
fn model_files() -> Vec<PathBuf> {
    let source = crate_root().join("src");
    rust_files(&source)
        .into_iter()
        .filter(|path| !path.starts_with(source.join("provider")))
        .collect()
}

fn read(path: &Path) -> String {
    fs::read_to_string(path)
        .unwrap_or_else(|error| panic!("cannot read {}: {error}", path.display()))
}

#[test]
fn the_model_imports_no_provider() {
    let mut offenders = Vec::new();
    for path in model_files() {
        for (number, line) in read(&path).lines().enumerate() {
            if line.contains("crate::provider") || line.contains("super::provider") {
                offenders.push(format!(
                    "{}:{}: {}",
                    path.display(),
                    number + 1,
                    line.trim()
                ));
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "model files must reach providers only through crate::seam:\n{}",
        offenders.join("\n")
    );
}

/// The providers: every module under `src/provider/` but the dispatch and the shared engine.
fn provider_names(providers: &Path) -> Vec<String> {
    let entries = fs::read_dir(providers).expect("list src/provider");
    let mut names: Vec<String> = entries
        .filter_map(|entry| {
            let path = entry.ok()?.path();
            let name = path.file_stem()?.to_str()?.to_string();
            (path.is_dir() || path.extension().is_some_and(|extension| extension == "rs"))
                .then_some(name)
        })
        .filter(|name| name != "mod" && name != "engine")
        .collect();
    names.sort();
    names.dedup();
    names
}

#[test]
fn providers_do_not_import_each_other() {
    let providers = crate_root().join("src/provider");
    let names = provider_names(&providers);
    assert!(
        names.iter().any(|name| name == "soft"),
        "found providers: {names:?}"
    );
    let mut offenders = Vec::new();
    for path in rust_files(&providers) {
        let relative = path.strip_prefix(&providers).expect("under provider/");
        let own = relative
            .components()
            .next()
            .and_then(|component| component.as_os_str().to_str())
            .map(|name| name.trim_end_matches(".rs").to_string())
            .unwrap_or_default();
        if own == "mod" {
            continue; // the dispatch point names them all
        }
        for (number, line) in read(&path).lines().enumerate() {
            for name in &names {
                let imports = [
                    format!("crate::provider::{name}"),
                    format!("super::{name}"),
                    format!("super::super::{name}"),
                ];
                if *name != own && imports.iter().any(|import| line.contains(import.as_str())) {
                    offenders.push(format!(
                        "{}:{}: {}",
                        path.display(),
                        number + 1,
                        line.trim()
                    ));
                }
            }
        }
    }
    assert!(
        offenders.is_empty(),
        "a provider may share the engine, never another provider:\n{}",
        offenders.join("\n")
    );
}

#[test]
fn the_verbs_feature_stays_in_its_provider_and_the_dispatch() {
    let root = crate_root();
    let allowed = [
        root.join("src/provider/verbs"),
        root.join("src/provider/mod.rs"),
    ];
    let mut uses = Vec::new();
    for directory in ["src", "tests", "benches"] {
        for path in rust_files(&root.join(directory)) {
            if allowed.iter().any(|allowed| path.starts_with(allowed)) {
                continue;
            }
            for (number, line) in read(&path).lines().enumerate() {
                // The needle is split so that this file does not count itself.
                if line.contains(concat!("feature = ", "\"verbs\"")) {
                    uses.push(format!(
                        "{}:{}: {}",
                        path.display(),
                        number + 1,
                        line.trim()
                    ));
                }
            }
        }
    }
    assert!(
        uses.len() <= 3,
        "cfg(feature = \"verbs\") belongs in provider/verbs/ and the dispatch; {} uses elsewhere:\n{}",
        uses.len(),
        uses.join("\n")
    );
}
