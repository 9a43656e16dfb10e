//! Binaries of the workspace that tests run as processes, built with cargo when a test first
//! needs one.

use std::{
    path::PathBuf,
    process::{Command, Stdio},
};

use serde_json::Value;

/// Runs `cargo build <args>` in this package and returns the executable it built for `target`.
///
/// The build runs without what cargo set for this test process (build scripts such as ring's
/// rebuild when `CARGO_PKG_*` differ), so that neither build undoes the other.
pub(crate) fn build(target: &str, args: &[&str]) -> PathBuf {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut command = Command::new(cargo);
    for (name, _) in std::env::vars_os() {
        let name = name.to_string_lossy();
        let set_for_tests = ["CARGO_PKG_", "CARGO_MANIFEST_", "CARGO_BIN_EXE_"]
            .iter()
            .any(|prefix| name.starts_with(prefix))
            || [
                "CARGO_CRATE_NAME",
                "CARGO_PRIMARY_PACKAGE",
                "CARGO_TARGET_TMPDIR",
                "OUT_DIR",
            ]
            .contains(&name.as_ref());
        if set_for_tests {
            command.env_remove(name.as_ref());
        }
    }
    let output = command
        .arg("build")
        .args(args)
        .arg("--message-format=json-render-diagnostics")
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .stderr(Stdio::inherit())
        .output()
        .expect("cargo runs");
    assert!(output.status.success(), "building {target} failed");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|line| serde_json::from_str::<Value>(line).ok())
        .filter(|m| m["reason"] == "compiler-artifact" && m["target"]["name"] == target)
        .find_map(|m| m["executable"].as_str().map(PathBuf::from))
        .unwrap_or_else(|| panic!("cargo built no {target} binary"))
}
