//! `relaybus purge`: the store's purge, with its cutoffs.

use std::{io::IsTerminal, process::ExitCode, time::Duration};

use indicatif::ProgressBar;
use relaybus::{PurgeOptions, store::Administration};
use serde_json::json;

use crate::{
    failure::{Failure, bad},
    options::PurgeArgs,
    output, selection,
    time::parse_time,
};

pub(super) async fn run<S: Administration>(
    store: &S,
    json: bool,
    args: &PurgeArgs,
) -> Result<ExitCode, Failure> {
    let mut options = PurgeOptions::new();
    let mut what = Vec::new();
    if let Some(dead) = &args.dead_before {
        let cutoff = parse_time("dead-before", dead)?;
        options = options.dead_before(cutoff);
        what.push(format!("dead letters buried before {cutoff}"));
    }
    if let Some(completed) = &args.completed_before {
        let cutoff = parse_time("completed-before", completed)?;
        options = options.completed_before(cutoff);
        what.push(format!(
            "completion records and finished events of before {cutoff}"
        ));
    }
    if what.is_empty() {
        return bad("say what to purge: --dead-before TIME, --completed-before TIME, or both");
    }
    let what = what.join(", and ");
    if args.dry_run {
        if json {
            output::json_line(&json!({ "dry_run": true, "would_delete": what }));
        } else {
            println!("dry run: would delete {what}; nothing changed");
        }
        return Ok(ExitCode::SUCCESS);
    }
    if !args.yes {
        selection::confirm(&format!("delete {what}?"))?;
    }
    let spinner = if std::io::stderr().is_terminal() {
        let spinner = ProgressBar::new_spinner().with_message("purging");
        spinner.enable_steady_tick(Duration::from_millis(100));
        spinner
    } else {
        ProgressBar::hidden()
    };
    let purged = store.purge(&options).await;
    spinner.finish_and_clear();
    let purged = purged?;
    if json {
        output::json_line(&json!({
            "dead_deliveries": purged.dead_deliveries,
            "completion_records": purged.completion_records,
            "events": purged.events,
        }));
    } else {
        output::table(
            &["DELETED", "COUNT"],
            &[
                vec![
                    "dead letters".to_owned(),
                    purged.dead_deliveries.to_string(),
                ],
                vec![
                    "completion records".to_owned(),
                    purged.completion_records.to_string(),
                ],
                vec!["events".to_owned(), purged.events.to_string()],
            ],
        );
    }
    Ok(ExitCode::SUCCESS)
}
