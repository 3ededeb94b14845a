//! `rdkv-cluster resize`: a node's `index_size` and `heap_size` grown in the cluster file,
//! checked against this machine before anything stops, then the node restarted with them
//! (`docs/operations.md`, *Growing a node's table*).
//!
//! The edit keeps the file as written (comments, order, the other nodes' sections): only the
//! node's two values change. The edited text is checked as `up` checks a file (units, limits,
//! this machine's memlock limit and memory for that node) in a file beside the original, which
//! it then replaces, so a refused resize leaves the file and the node as they were.

use std::fs;
use std::path::{Path, PathBuf};

use toml_edit::{value, DocumentMut, Item, Table, Value};

use crate::{ClusterConfig, Error, Result};

/// The sizes `resize` asks for, as the cluster file writes them (`"4M"`, `"1G"`); `None`
/// keeps the node's.
#[derive(Debug, Clone, Copy)]
pub struct NewSizes<'a> {
    /// The new `index_size`.
    pub index_size: Option<&'a str>,
    /// The new `heap_size`.
    pub heap_size: Option<&'a str>,
}

/// Writes node `node`'s new sizes into the cluster file `before` was loaded from: the edited
/// text must load as `up` loads a file, with the node's table pinnable on this machine, and
/// must not shrink either size. The cluster as the edited file says, and a line saying what
/// changed.
///
/// # Errors
/// [`Error::Refused`] naming the fix: no new size given, the node not in the file, a size
/// smaller than the node's, or the edited file invalid or too large for this machine (the
/// file is left as it was).
pub fn write_sizes(
    before: &ClusterConfig,
    node: u32,
    sizes: NewSizes<'_>,
) -> Result<(ClusterConfig, String)> {
    if sizes.index_size.is_none() && sizes.heap_size.is_none() {
        return Err(Error::Refused(
            "nothing to resize: give --index-size, --heap-size or both".into(),
        ));
    }
    let old = before.node(node).ok_or_else(|| {
        Error::Refused(format!("node {node} is not in {}", before.path.display()))
    })?;
    let path = &before.path;
    let text = fs::read_to_string(path)
        .map_err(|error| Error::Refused(format!("read {}: {error}", path.display())))?;
    let edited = edit_sizes(&text, node, sizes)
        .map_err(|reason| Error::Refused(format!("{}: {reason}", path.display())))?;
    let candidate = candidate_path(path);
    write_private(&candidate, &edited)
        .and_then(|()| fs::set_permissions(&candidate, fs::metadata(path)?.permissions()))
        .map_err(|error| Error::Refused(format!("write {}: {error}", candidate.display())))?;
    let checked = rdkv_cluster_file::config::load_to_start(&candidate, None, Some(node));
    let checked = match checked {
        Ok(checked) => checked,
        Err(error) => {
            let _ = fs::remove_file(&candidate);
            return Err(Error::Refused(format!(
                "the new sizes were not written, the node not restarted: {error}"
            )));
        }
    };
    let new = checked
        .node(node)
        .ok_or_else(|| Error::Refused(format!("node {node} vanished from the edited file")))?;
    if new.index_size < old.index_size || new.heap_size < old.heap_size {
        let _ = fs::remove_file(&candidate);
        return Err(Error::Refused(format!(
            "node {node}: a table only grows (index_size {} → {}, heap_size {} → {}): its keys may not fit a smaller one",
            old.index_size, new.index_size, old.heap_size, new.heap_size
        )));
    }
    let said = format!(
        "node {node}: index_size {} → {} bytes, heap_size {} → {} bytes, written to {}",
        old.index_size,
        new.index_size,
        old.heap_size,
        new.heap_size,
        path.display()
    );
    fs::rename(&candidate, path)
        .map_err(|error| Error::Refused(format!("replace {}: {error}", path.display())))?;
    let config = rdkv_cluster_file::config::load_to_start(path, None, Some(node))?;
    Ok((config, said))
}

/// The checked copy's path: beside the file, so that the paths it names (`secret_file`,
/// `data_dir`) resolve as the original's do.
fn candidate_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map_or_else(|| "cluster.toml".into(), |name| name.to_string_lossy());
    path.with_file_name(format!(".{name}.resize"))
}

/// Writes `text` to `path`, readable by its owner only from the start (the file may hold the
/// cluster's secret); a copy left by an earlier run is replaced.
fn write_private(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let _ = fs::remove_file(path);
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)?;
    file.write_all(text.as_bytes())
}

/// `text` with node `node`'s sizes replaced, or why not.
fn edit_sizes(text: &str, node: u32, sizes: NewSizes<'_>) -> std::result::Result<String, String> {
    let mut document: DocumentMut = text.parse().map_err(|error| format!("not TOML: {error}"))?;
    let sections = document
        .get_mut("node")
        .and_then(Item::as_array_of_tables_mut)
        .ok_or("no [[node]] sections")?;
    let section = sections
        .iter_mut()
        .find(|section| {
            section
                .get("id")
                .and_then(Item::as_integer)
                .is_some_and(|id| id == i64::from(node))
        })
        .ok_or_else(|| format!("no [[node]] section with id = {node}"))?;
    if let Some(size) = sizes.index_size {
        set_keeping_comments(section, "index_size", size);
    }
    if let Some(size) = sizes.heap_size {
        set_keeping_comments(section, "heap_size", size);
    }
    Ok(document.to_string())
}

/// Sets `key` to the string `size`, keeping the spaces and comment around the old value.
fn set_keeping_comments(section: &mut Table, key: &str, size: &str) {
    match section.get_mut(key).and_then(Item::as_value_mut) {
        Some(existing) => {
            let decor = existing.decor().clone();
            *existing = Value::from(size);
            *existing.decor_mut() = decor;
        }
        None => section[key] = value(size),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = "[cluster]\nname = \"c\" # the name\n\n[[node]]\nid = 1\nindex_size = \"1M\"\nheap_size = \"4M\"\n\n[[node]]\nid = 2\nindex_size = \"1M\" # small\nheap_size = \"4M\"\n";

    #[test]
    fn only_the_node_s_sizes_change_and_comments_stay() {
        let sizes = NewSizes {
            index_size: Some("4M"),
            heap_size: None,
        };
        let edited = edit_sizes(FILE, 2, sizes).expect("edited");
        assert_eq!(
            edited,
            FILE.replace("index_size = \"1M\" # small", "index_size = \"4M\" # small")
        );
    }

    #[test]
    fn a_node_not_in_the_file_is_named() {
        let sizes = NewSizes {
            index_size: Some("4M"),
            heap_size: Some("8M"),
        };
        let refused = edit_sizes(FILE, 3, sizes).expect_err("no node 3");
        assert!(refused.contains("id = 3"), "{refused}");
    }
}
