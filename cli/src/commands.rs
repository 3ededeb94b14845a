//! The key commands, one function each: `get`, `put`, `insert`, `del` and `cas`. Each reads its
//! key and values (`input`), calls the client, prints what it found (`output`) and returns the
//! exit code of its outcome (the crate docs list them).

use std::process::ExitCode;

use anyhow::Context;
use rdkv_client::{CasOutcome, Client, InsertOutcome};

use crate::input::{self, KeyArgument};
use crate::output::{describe_key, describe_value, print_value};

/// `rdkv get`: prints the value (exit 1 when absent).
pub async fn get(client: &Client, key: KeyArgument, hex: bool) -> anyhow::Result<ExitCode> {
    let key = key.bytes()?;
    let shown = describe_key(&key);
    match client
        .get(&key)
        .await
        .with_context(|| format!("get {shown}"))?
    {
        Some(value) => {
            print_value(&value, hex).context("write the value to stdout")?;
            Ok(ExitCode::SUCCESS)
        }
        None => {
            eprintln!("rdkv: {shown}: not found");
            Ok(ExitCode::from(1))
        }
    }
}

/// `rdkv put`: stores the value (or stdin).
pub async fn put(
    client: &Client,
    key: KeyArgument,
    value: Option<String>,
    value_hex: bool,
) -> anyhow::Result<ExitCode> {
    let value = input::value_or_stdin(value, value_hex, &key)?;
    let key = key.bytes()?;
    client
        .put(&key, &value)
        .await
        .with_context(|| format!("put {}", describe_key(&key)))?;
    Ok(ExitCode::SUCCESS)
}

/// `rdkv insert`: stores the value (or stdin) only if the key is absent; when it is present,
/// prints its value (exit 1).
pub async fn insert(
    client: &Client,
    key: KeyArgument,
    value: Option<String>,
    value_hex: bool,
    hex: bool,
) -> anyhow::Result<ExitCode> {
    let value = input::value_or_stdin(value, value_hex, &key)?;
    let key = key.bytes()?;
    let shown = describe_key(&key);
    match client
        .insert_or_get(&key, &value)
        .await
        .with_context(|| format!("insert {shown}"))?
    {
        InsertOutcome::Inserted => Ok(ExitCode::SUCCESS),
        InsertOutcome::Present(present) => {
            eprintln!("rdkv: {shown}: present, not inserted");
            print_value(&present, hex).context("write the value to stdout")?;
            Ok(ExitCode::from(1))
        }
    }
}

/// `rdkv del`: deletes the key (exit 1 when absent).
pub async fn delete(client: &Client, key: KeyArgument) -> anyhow::Result<ExitCode> {
    let key = key.bytes()?;
    let shown = describe_key(&key);
    if client
        .delete(&key)
        .await
        .with_context(|| format!("delete {shown}"))?
    {
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!("rdkv: {shown}: not found");
        Ok(ExitCode::from(1))
    }
}

/// `rdkv cas`: replaces the value with `new` only if it is `expected`; when not, names the
/// value found (exit 1).
pub async fn compare_and_swap(
    client: &Client,
    key: KeyArgument,
    expected: String,
    new: String,
    value_hex: bool,
    hex: bool,
) -> anyhow::Result<ExitCode> {
    let expected = input::value_bytes(expected, value_hex, "EXPECTED")?;
    let new = input::value_bytes(new, value_hex, "NEW")?;
    let key = key.bytes()?;
    let shown = describe_key(&key);
    match client
        .compare_and_swap(&key, &expected, &new)
        .await
        .with_context(|| format!("compare-and-swap {shown}"))?
    {
        CasOutcome::Swapped => Ok(ExitCode::SUCCESS),
        CasOutcome::Mismatch(current) => {
            match current {
                Some(current) => eprintln!(
                    "rdkv: {shown}: not swapped; the value is {}",
                    describe_value(&current, hex)
                ),
                None => eprintln!("rdkv: {shown}: not swapped; the key is absent"),
            }
            Ok(ExitCode::from(1))
        }
    }
}
