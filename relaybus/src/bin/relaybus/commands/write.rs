//! `relaybus requeue`, `discard` and `bury`: by ids, or by filter after a count and a
//! confirmation, in batches with a progress bar.

use std::{io::IsTerminal, process::ExitCode};

use indicatif::{ProgressBar, ProgressStyle};
use relaybus::{DeliveryQuery, DeliveryStatus, Timestamp, store::Administration};
use serde_json::json;

use crate::{
    failure::{Failure, PARTLY, bad},
    options::WriteArgs,
    output, selection,
};

/// Ids per store call: each batch is one call, and one step of the progress bar.
const BATCH: usize = 1_000;

/// Which write.
#[derive(Debug)]
pub(crate) enum Write {
    Requeue,
    Discard,
    /// With its reason.
    Bury(String),
}

impl Write {
    fn verb(&self) -> &'static str {
        match self {
            Write::Requeue => "requeue",
            Write::Discard => "discard",
            Write::Bury(_) => "bury",
        }
    }

    fn done(&self) -> &'static str {
        match self {
            Write::Requeue => "requeued",
            Write::Discard => "discarded",
            Write::Bury(_) => "buried",
        }
    }

    /// What it takes: dead letters, or pending deliveries.
    fn takes(&self) -> (DeliveryStatus, &'static str) {
        match self {
            Write::Requeue | Write::Discard => (DeliveryStatus::Dead, "dead letters"),
            Write::Bury(_) => (DeliveryStatus::Pending, "pending deliveries"),
        }
    }
}

/// What a write did with each id, summed over its batches.
#[derive(Debug, Default)]
struct Outcome {
    changed: Vec<String>,
    /// Left alone: blocked behind a running delivery of the key (requeue), or running
    /// (bury).
    left: Vec<String>,
    not_found: Vec<String>,
}

pub(super) async fn run<S: Administration>(
    store: &S,
    json: bool,
    write: Write,
    args: &WriteArgs,
) -> Result<ExitCode, Failure> {
    if let Write::Bury(reason) = &write
        && (reason.trim().is_empty() || reason.len() > 1_024)
    {
        return bad("--reason must say why, in 1 to 1024 bytes");
    }
    let (status, what) = write.takes();
    let by_filter = args.all || !args.filter.is_empty();
    let ids = match (args.ids.is_empty(), by_filter) {
        (false, false) => selection::checked_ids(store, &args.ids)?,
        (true, true) => {
            if args.all && !args.filter.is_empty() {
                return bad("--all selects every one: leave the filters out, or --all");
            }
            let query =
                selection::filtered(store, DeliveryQuery::new().status(status), &args.filter)
                    .await?;
            selection::ids_of(store, &query).await?
        }
        (false, true) => {
            return bad("give delivery ids or a filter (or --all), not both");
        }
        (true, false) => {
            return bad(format!(
                "name the {what} to {}: give their ids, or select them with a filter \
                 (--handler, --event-type, --key, --event-id, --error, --last-error, \
                 --created-from, --created-before) or --all",
                write.verb()
            ));
        }
    };

    if by_filter {
        if json {
            output::json_line(&json!({ "matched": ids.len() }));
        } else {
            println!("{} {what} match", ids.len());
        }
    }
    if args.dry_run {
        if json {
            output::json_line(&json!({ "dry_run": true, "would": write.verb(), "ids": ids }));
        } else {
            println!(
                "dry run: would {} {} {what}; nothing changed",
                write.verb(),
                ids.len()
            );
        }
        return Ok(ExitCode::SUCCESS);
    }
    if ids.is_empty() {
        return Ok(ExitCode::SUCCESS);
    }
    if by_filter && !args.yes {
        selection::confirm(&format!("{} {} {what}?", write.verb(), ids.len()))?;
    }

    let outcome = apply(store, &write, &ids).await?;
    report(json, &write, &outcome);
    Ok(if outcome.left.is_empty() && outcome.not_found.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(PARTLY)
    })
}

/// Runs the write over `ids` in batches, showing progress on standard error: a bar on a
/// terminal, a line per batch otherwise.
async fn apply<S: Administration>(
    store: &S,
    write: &Write,
    ids: &[String],
) -> Result<Outcome, Failure> {
    let terminal = std::io::stderr().is_terminal();
    let bar = if terminal {
        let bar = ProgressBar::new(ids.len() as u64);
        bar.set_style(
            ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} ({eta})")
                .expect("a valid template")
                .progress_chars("=> "),
        );
        bar.set_message(write.verb());
        bar
    } else {
        ProgressBar::hidden()
    };
    let mut outcome = Outcome::default();
    let mut done = 0;
    for batch in ids.chunks(BATCH) {
        let now = Timestamp::now();
        match write {
            Write::Requeue => {
                let r = store.requeue(batch, now).await?;
                outcome.changed.extend(r.requeued);
                outcome.left.extend(r.blocked);
                outcome.not_found.extend(r.not_found);
            }
            Write::Discard => {
                let r = store.discard(batch, now).await?;
                outcome.changed.extend(r.discarded);
                outcome.not_found.extend(r.not_found);
            }
            Write::Bury(reason) => {
                let r = store.bury_by_id(batch, reason, now).await?;
                outcome.changed.extend(r.buried);
                outcome.left.extend(r.running);
                outcome.not_found.extend(r.not_found);
            }
        }
        done += batch.len();
        bar.set_position(done as u64);
        if !terminal {
            eprintln!("relaybus: {}: {done}/{}", write.verb(), ids.len());
        }
    }
    bar.finish_and_clear();
    Ok(outcome)
}

fn report(json: bool, write: &Write, outcome: &Outcome) {
    let left = match write {
        Write::Requeue => "blocked",
        Write::Discard => "left",
        Write::Bury(_) => "running",
    };
    if json {
        output::json_line(&json!({
            write.done(): outcome.changed.len(),
            left: outcome.left,
            "not_found": outcome.not_found,
        }));
        return;
    }
    println!("{}: {}", write.done(), outcome.changed.len());
    if !outcome.left.is_empty() {
        let why = match write {
            Write::Requeue => "a later delivery of their key runs; try again once it finished",
            _ => "a worker runs them; their result settles them",
        };
        println!(
            "{left}: {} ({why}): {}",
            outcome.left.len(),
            outcome.left.join(" ")
        );
    }
    if !outcome.not_found.is_empty() {
        let (_, what) = write.takes();
        println!(
            "not found: {} (no {what} with these ids): {}",
            outcome.not_found.len(),
            outcome.not_found.join(" ")
        );
    }
}
