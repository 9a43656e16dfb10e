//! `relaybus setup`: creates or upgrades the store; `--dry-run` prints the plan.

use std::process::ExitCode;

use relaybus::store::{Administration, SetupStep};
use serde_json::json;

use crate::{failure::Failure, output};

pub(super) async fn run<S: Administration>(
    store: &S,
    json: bool,
    dry_run: bool,
) -> Result<ExitCode, Failure> {
    let plan = store.setup_plan().await?;
    if !dry_run {
        store.setup().await?;
    }
    if json {
        for step in &plan {
            output::json_line(&json!({
                "step": step.kind.as_str(),
                "description": step.description,
                "done": !dry_run,
            }));
        }
    } else {
        print_plan(&plan, dry_run);
    }
    Ok(ExitCode::SUCCESS)
}

fn print_plan(plan: &[SetupStep], dry_run: bool) {
    if plan.is_empty() {
        println!("nothing to do: the store is set up");
        return;
    }
    let rows: Vec<Vec<String>> = plan
        .iter()
        .map(|step| vec![step.kind.as_str().to_owned(), step.description.clone()])
        .collect();
    output::table(&["KIND", "WHAT"], &rows);
    if dry_run {
        println!("dry run: {} steps, nothing changed", plan.len());
    } else {
        println!("done: {} steps, the store is set up", plan.len());
    }
}
