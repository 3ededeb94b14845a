//! The snapshot file format: written to a temporary file, fsynced, renamed into place; read
//! back only whole and checked.
