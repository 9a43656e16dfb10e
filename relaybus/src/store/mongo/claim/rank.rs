//! Ranking free lanes: which lanes no live owner holds have due deliveries of the claim's
//! handlers, the lane with the oldest due delivery first, and which of them the claim takes.
//!
//! A claim that needs more than its held lanes gave looks at free lanes in rounds of twice as
//! many lanes each (4 at first, more for a big claim), never more than the picks it still
//! misses. With other live holders around, it picks among a wider set of old lanes, only those
//! of its own slot among the holders while there are any (see [`choose`]), so that concurrent
//! claimers take different lanes. Ranking costs more than
//! scanning a few lanes, so the rest of a ranking is kept for the owner's next claims, for a
//! second.
//!
//! A ranking first reads the free lanes' due entries in the claim index's own order, as many as
//! the merge would, and ranks only the lanes past where that pass stopped by a merge of one
//! index range per lane (see `rank_lanes`): a merge over lanes just drained reads the entries their
//! completions left behind once per lane, which cost a drained collection more than every other
//! read of a claim together.
//!
//! A ranking that saw every due delivery of the free lanes it read (it read fewer index entries
//! than it could) also says that the lanes it did not list had nothing due. While the change
//! stream reports every new delivery to the owner's claims (they look at the reported lanes
//! first), that holds for a quarter of a second: a busy claim that its held lanes do not fill,
//! as with a few hot keys, does not read every free lane again each time. A lane freed since
//! the ranking was not read, and makes the next claim rank again.
//!
//! The specification takes 4, 8 and 16 free lanes per round, oldest due first; this tuned
//! variant is listed among the README's differences from the specification, and
//! `tests/tests/specification.rs` checks that every lane a round takes is among the oldest
//! `round × spread` free ones it has not tried yet.

use std::{
    collections::{HashMap, HashSet},
    time::Duration,
};

use futures::{TryStreamExt, future};
use mongodb::bson::{DateTime, Document, doc};

use super::{
    Request,
    read::FreeLane,
    scan::{LANES_PER_QUERY, Scan, scan_filter},
    share::Sharing,
    take::Hold,
};
use crate::{
    error::{Error, Result},
    store::mongo::{
        MongoEventStore,
        lane::{Lane, int, int32},
        lease::{RankedLanes, same_handlers},
        schema::{field, index},
    },
};

/// Free lanes taken in the first round; every further round takes twice as many.
const FIRST_ROUND: usize = 4;
/// Deliveries a claim expects from a free lane when it sizes its first round.
const DELIVERIES_PER_LANE: usize = 8;
/// The most free lanes the first round takes.
const MAX_FIRST_ROUND: usize = 64;
/// Index entries one free-lane discovery query reads per group of lanes, at most.
const DISCOVERY_WINDOW: i64 = 512;
/// The most claimers a claim assumes it competes with when it spreads over free lanes.
const MAX_SPREAD: usize = 8;

/// How long the rest of a ranking of free lanes serves the owner's next claims, by the claims'
/// clock. New deliveries are never due before the ones ranked; a retry that became due since is
/// seen by the next ranking, at most this much later.
const RANKING_REUSE: Duration = Duration::from_secs(1);

/// How long a ranking that saw every due delivery of the free lanes it read tells the owner's
/// next claims that the lanes it did not list have nothing due, while the change stream reports
/// every new delivery. A delivery that becomes due there without being inserted (a retry, a
/// release, an unpark by another owner) is seen by the next ranking, at most this much later.
const COMPLETE_RANKING_REUSE: Duration = Duration::from_millis(250);

/// `count` of the `ranked` lanes (oldest due delivery first). Alone, a claimer takes the oldest;
/// with others around it takes, oldest first, those among the oldest `count * spread` that fall
/// to its `slot` among the holders (the lane's id modulo `spread`), which claimers that see the
/// same holders never share. When none of them does, and only if it may `help` (the claim has
/// found nothing yet), it takes `count` others at random among the oldest: a claimer whose own
/// lanes are drained helps with the others', while a claim that went on into the others' lanes
/// after its own would take lanes their claims are taking at the same time, and all but one of
/// them would lose those lanes at the record.
fn choose(mut ranked: Vec<i32>, count: usize, spread: usize, slot: usize, help: bool) -> Vec<i32> {
    if spread <= 1 {
        ranked.truncate(count);
        return ranked;
    }
    ranked.truncate(count.saturating_mul(spread));
    let slot = slot % spread;
    let (mut chosen, mut rest): (Vec<i32>, Vec<i32>) = ranked
        .into_iter()
        .partition(|lane| usize::try_from(lane.rem_euclid(spread as i32)).ok() == Some(slot));
    if !chosen.is_empty() || !help {
        chosen.truncate(count);
        return chosen;
    }
    // The low bits of a UUID v7 are random.
    let mut state = uuid::Uuid::now_v7().as_u128() as u64 | 1;
    for i in 0..count.min(rest.len()) {
        // xorshift64
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let j = i + (state % (rest.len() - i) as u64) as usize;
        rest.swap(i, j);
    }
    rest.truncate(count);
    rest
}

/// What a kept ranking still offers a claim.
#[derive(Debug, PartialEq)]
struct Kept {
    /// Its lanes that are still free, oldest due delivery first.
    lanes: Vec<i32>,
    /// When it was ranked.
    at: DateTime,
    /// It saw every due delivery of every lane still free: the free lanes it does not list
    /// had nothing due when it was ranked.
    complete: bool,
    /// The free lanes it read in full.
    covered: Vec<i32>,
}

/// The lanes of a kept ranking that are still free, in ranking order, with the time of the
/// ranking and whether it covers every lane still free; `None` when it was for other handlers
/// or is too old.
fn reusable(
    ranking: Option<RankedLanes>,
    handlers: &[&str],
    now: DateTime,
    free: &[i32],
) -> Option<Kept> {
    let ranking = ranking?;
    let age = now
        .timestamp_millis()
        .checked_sub(ranking.at.timestamp_millis())?;
    if age < 0
        || age > RANKING_REUSE.as_millis() as i64
        || !same_handlers(&ranking.handlers, handlers)
    {
        return None;
    }
    let lanes: Vec<i32> = ranking
        .lanes
        .into_iter()
        .filter(|lane| free.contains(lane))
        .collect();
    // A lane freed since (handed back, or its lease ended) was not read: rank again.
    let complete = age <= COMPLETE_RANKING_REUSE.as_millis() as i64
        && !ranking.covered.is_empty()
        && free.iter().all(|lane| ranking.covered.contains(lane));
    Some(Kept {
        lanes,
        at: ranking.at,
        complete,
        covered: ranking.covered,
    })
}

impl MongoEventStore {
    /// Scans free lanes until the claim is full or no free lane has due deliveries: 4, 8, 16,
    /// ... lanes per round (more for a big claim), the lanes with the oldest due delivery first.
    /// Nothing is written yet for a lane with nothing to charge: the record takes it, on
    /// condition that nobody took it since it was read. A lane with lost claims or an earlier
    /// holder's in-flight list is taken first and charged before it is read. `ranking` is the
    /// owner's kept ranking: used if it is recent, and replaced by the rest of a new one.
    pub(super) async fn scan_free_lanes(
        &self,
        request: &Request<'_>,
        mut free: Vec<FreeLane>,
        sharing: &Sharing,
        ranking: &mut Option<RankedLanes>,
        lanes: &mut Vec<(Lane, Hold)>,
        scan: &mut Scan,
    ) -> Result<()> {
        let Request { handlers, now, .. } = *request;
        let limit = scan.picking.limit;
        // The held lanes were scanned already.
        let mut tried: HashSet<i32> = lanes.iter().map(|(lane, _)| lane.id).collect();
        // A big claim starts with more lanes, so that it needs fewer rounds now and finds more
        // in the lanes it holds next time.
        let mut round = ((limit - scan.picking.picks.len().min(limit)) / DELIVERIES_PER_LANE)
            .clamp(FIRST_ROUND, MAX_FIRST_ROUND);
        let spread = sharing.claimers.clamp(1, MAX_SPREAD);
        // Set once a ranking of this claim saw every due delivery of the lanes it ranked: the
        // free lanes it did not list have nothing to claim.
        let mut complete = false;
        while !scan.picking.full() {
            free.retain(|lane| !tried.contains(&lane.lane.id));
            if free.is_empty() {
                break;
            }
            let free_ids: Vec<i32> = free.iter().map(|lane| lane.lane.id).collect();
            // The rest of a recent ranking serves while it has enough lanes that are still
            // free: ranking reads one index range per free lane, scanning a few lanes
            // does not.
            let kept = reusable(ranking.take(), handlers, now, &free_ids);
            let (ranked, ranked_at, covered) = match kept {
                Some(kept) if kept.lanes.len() >= round || complete || kept.complete => {
                    complete |= kept.complete;
                    (kept.lanes, kept.at, kept.covered)
                }
                _ if complete => break,
                _ => {
                    let (ranked, seen_all) = self
                        .rank_lanes(&free_ids, handlers, now, round.saturating_mul(spread))
                        .await?;
                    complete = seen_all;
                    let covered = if seen_all { free_ids } else { Vec::new() };
                    (ranked, now, covered)
                }
            };
            // Other claimers' lanes only for a claim that found nothing in its own.
            let help = scan.picking.picks.is_empty();
            let chosen = choose(ranked.clone(), round, spread, sharing.slot, help);
            let rest: Vec<i32> = ranked
                .into_iter()
                .filter(|lane| !chosen.contains(lane))
                .collect();
            // A complete ranking is kept even when nothing is left of it: it tells the next
            // claims that the free lanes it read have nothing due, without reading them again.
            *ranking = (!rest.is_empty() || complete).then(|| RankedLanes {
                handlers: handlers.iter().map(|h| (*h).to_owned()).collect(),
                at: ranked_at,
                lanes: rest,
                covered,
            });
            if chosen.is_empty() {
                break;
            }
            tried.extend(chosen.iter().copied());
            let scanned = self.join_lanes(&chosen, &free, lanes, request).await?;
            self.scan_lanes(&scanned, handlers, now, scan).await?;
            // Twice as many lanes next time, but no more than the picks still missing: a lane
            // that yields anything yields at least one pick, so lanes beyond that would be
            // taken and handed back for nothing, while other claimers may want them.
            let missing = limit.saturating_sub(scan.picking.picks.len());
            round = round.saturating_mul(2).min(missing.max(FIRST_ROUND));
        }
        Ok(())
    }

    /// The `free` lanes with due deliveries of `handlers` that the oldest entries of the claim
    /// index show (enough to find `count` lanes, unless a few lanes hold all the oldest work),
    /// the lane with the oldest due delivery first; and whether these are all the `free` lanes
    /// with due deliveries (the queries read fewer entries than they could).
    ///
    /// A probe reads the free lanes' due entries first, in index order (lane by lane, each
    /// lane's oldest first), as many as the merge reads: the lanes it reaches are known with
    /// their oldest due delivery. Only the lanes past where it stopped are ranked by the oldest
    /// entries across lanes, a merge of one index range per lane. That merge starts every range
    /// at its beginning, and a range whose deliveries were just completed or parked is a run of
    /// deleted entries the storage engine keeps until it cleans the page up: read once per lane,
    /// a few hundred such lanes cost a drained collection tens of milliseconds of the server's
    /// time per ranking, where the probe's one pass in index order costs well under one.
    async fn rank_lanes(
        &self,
        free: &[i32],
        handlers: &[&str],
        now: DateTime,
        count: usize,
    ) -> Result<(Vec<i32>, bool)> {
        // Enough index entries to find `count` lanes unless a few lanes hold all the oldest
        // work; the next round then looks again without them.
        let window = (count as i64 * 8).clamp(32, DISCOVERY_WINDOW);
        let (mut oldest, unprobed) = self.probe_lanes(free, handlers, now, window).await?;
        let queries = unprobed.chunks(LANES_PER_QUERY).map(|group| async move {
            let docs: Vec<Document> = self
                .inner
                .deliveries
                .find(scan_filter(group, handlers, now))
                .sort(doc! { field::DUE_AT: 1, field::ID: 1 })
                .projection(doc! { field::ID: 0, field::LANE_ID: 1, field::DUE_AT: 1 })
                .hint(index::hint(index::CLAIM))
                .limit(window)
                .batch_size(window as u32)
                .await?
                .try_collect()
                .await?;
            let seen_all = (docs.len() as i64) < window;
            Ok::<_, Error>((docs, seen_all))
        });
        let mut seen_all = true;
        for (docs, all) in future::try_join_all(queries).await? {
            seen_all &= all;
            for doc in docs {
                let (Some(lane), Ok(due)) =
                    (int32(&doc, field::LANE_ID), doc.get_datetime(field::DUE_AT))
                else {
                    continue;
                };
                let entry = oldest.entry(lane).or_insert(*due);
                if *due < *entry {
                    *entry = *due;
                }
            }
        }
        let mut ranked: Vec<(DateTime, i32)> = oldest.into_iter().map(|(l, d)| (d, l)).collect();
        ranked.sort();
        Ok((ranked.into_iter().map(|(_, lane)| lane).collect(), seen_all))
    }

    /// The oldest due delivery of each `free` lane the probe reached, and the free lanes it did
    /// not reach: none when it read every due entry of the free lanes. One pass over the claim
    /// index in its own order, up to `window` entries: the lanes come in ascending
    /// order, each with its oldest entry first, so every lane it reached is known whole, and
    /// those past the highest it reached were not read.
    async fn probe_lanes(
        &self,
        free: &[i32],
        handlers: &[&str],
        now: DateTime,
        window: i64,
    ) -> Result<(HashMap<i32, DateTime>, Vec<i32>)> {
        let docs: Vec<Document> = self
            .inner
            .deliveries
            .aggregate([
                doc! { "$match": scan_filter(free, handlers, now) },
                doc! { "$project": { field::ID: 0, field::LANE_ID: 1, field::DUE_AT: 1 } },
                doc! { "$limit": window },
                doc! { "$group": {
                    "_id": format!("${}", field::LANE_ID),
                    "due": { "$min": format!("${}", field::DUE_AT) },
                    "entries": { "$sum": 1 },
                } },
            ])
            .hint(index::hint(index::CLAIM))
            .await?
            .try_collect()
            .await?;
        let mut oldest = HashMap::with_capacity(docs.len());
        let mut entries = 0;
        let mut highest = i32::MIN;
        for doc in &docs {
            entries += int(doc, "entries").unwrap_or(0);
            let (Some(lane), Ok(due)) = (int32(doc, "_id"), doc.get_datetime("due")) else {
                continue;
            };
            highest = highest.max(lane);
            oldest.insert(lane, *due);
        }
        let unprobed = if entries < window {
            Vec::new()
        } else {
            free.iter()
                .copied()
                .filter(|lane| *lane > highest)
                .collect()
        };
        Ok((oldest, unprobed))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_ranking_serves_the_same_handlers_for_a_second_and_only_free_lanes() {
        let at = DateTime::from_millis(10_000);
        let kept = |covered: Vec<i32>| {
            Some(RankedLanes {
                handlers: vec!["a".into(), "b".into()],
                at,
                lanes: vec![5, 3, 9],
                covered,
            })
        };
        let later = |ms: i64| DateTime::from_millis(10_000 + ms);
        let lanes = |kept: Option<Kept>| kept.map(|kept| (kept.lanes, kept.at));
        assert_eq!(
            lanes(reusable(
                kept(vec![]),
                &["a", "b"],
                later(1_000),
                &[9, 5, 7]
            )),
            Some((vec![5, 9], at))
        );
        assert_eq!(
            reusable(kept(vec![]), &["a", "b"], later(1_001), &[5]),
            None
        );
        assert_eq!(reusable(kept(vec![]), &["a", "b"], later(-1), &[5]), None);
        assert_eq!(reusable(kept(vec![]), &["a"], later(0), &[5]), None);
        assert_eq!(reusable(kept(vec![]), &["b", "a"], later(0), &[5]), None);
        assert_eq!(reusable(None, &["a", "b"], later(0), &[5]), None);
    }

    #[test]
    fn a_kept_ranking_is_complete_only_while_it_covers_every_free_lane() {
        let ranking = |covered: Vec<i32>| {
            Some(RankedLanes {
                handlers: vec!["a".into()],
                at: DateTime::from_millis(0),
                lanes: vec![],
                covered,
            })
        };
        let complete_at = |ms: i64, covered: Vec<i32>, free: &[i32]| {
            reusable(ranking(covered), &["a"], DateTime::from_millis(ms), free)
                .map(|kept| kept.complete)
        };
        let complete = |covered: Vec<i32>, free: &[i32]| complete_at(250, covered, free);
        assert_eq!(complete(vec![1, 2, 3], &[1, 3]), Some(true));
        // Past a quarter of a second it still serves its lanes, but says nothing of the others.
        assert_eq!(complete_at(251, vec![1, 2, 3], &[1, 3]), Some(false));
        // Lane 4 was freed after the ranking: it was never read.
        assert_eq!(complete(vec![1, 2, 3], &[1, 4]), Some(false));
        // A ranking that was cut short covers nothing.
        assert_eq!(complete(vec![], &[1]), Some(false));
    }

    #[test]
    fn alone_a_claimer_takes_the_oldest_lanes_and_with_others_some_of_the_oldest() {
        let ranked: Vec<i32> = (0..40).collect();
        assert_eq!(choose(ranked.clone(), 4, 1, 0, true), vec![0, 1, 2, 3]);
        assert_eq!(choose(vec![5, 6], 4, 1, 0, true), vec![5, 6]);
        // Claimers in different slots take different lanes, each its own, oldest first.
        assert_eq!(choose(ranked.clone(), 4, 2, 0, true), vec![0, 2, 4, 6]);
        assert_eq!(choose(ranked.clone(), 4, 2, 1, true), vec![1, 3, 5, 7]);
        // Its own lanes (id % 3 == 1) among the oldest 12, although older lanes come first.
        let ranked_apart = vec![0, 3, 6, 9, 1, 2, 4, 5, 7, 8, 10, 11, 13, 16];
        assert_eq!(choose(ranked_apart, 4, 3, 1, true), vec![1, 4, 7, 10]);
        // One lane of slot 2 among the oldest 12 (lane 14 is not): that one alone, although
        // the round has room for more; the others' lanes are theirs.
        let few = vec![0, 3, 6, 9, 12, 5, 15, 18, 21, 24, 27, 30, 14];
        assert_eq!(choose(few.clone(), 4, 3, 2, true), vec![5]);
        // A slot beyond the spread wraps around.
        assert_eq!(choose(ranked.clone(), 4, 3, 4, true), vec![1, 4, 7, 10]);
        for _ in 0..20 {
            // None of slot 1 among the oldest 12: four others at random among them.
            let chosen = choose(few.clone(), 4, 3, 1, true);
            assert_eq!(chosen.len(), 4);
            assert!(
                chosen.iter().all(|lane| few[..12].contains(lane)),
                "{chosen:?}"
            );
            let mut distinct = chosen.clone();
            distinct.sort_unstable();
            distinct.dedup();
            assert_eq!(distinct.len(), 4);
            // Fewer lanes than the round, none of its slot: all of them.
            let mut two = choose(vec![5, 6], 4, 8, 0, true);
            two.sort_unstable();
            assert_eq!(two, vec![5, 6]);
        }
        // A claim that found something already takes none of the others' lanes.
        assert_eq!(choose(few.clone(), 4, 3, 1, false), Vec::<i32>::new());
        assert_eq!(choose(few.clone(), 4, 3, 2, false), vec![5]);
        assert_eq!(choose(ranked.clone(), 4, 1, 0, false), vec![0, 1, 2, 3]);
        // Fewer lanes than the round, one of its slot: that one.
        assert_eq!(choose(vec![5, 6], 4, 8, 6, true), vec![6]);
    }
}
