//! Ranking free lanes: which lanes no live owner holds have due deliveries of the claim's
//! handlers, the lane with the oldest due delivery first, and which of them the claim takes.
//!
//! A claim that needs more than its held lanes gave looks at free lanes in rounds of twice as
//! many lanes each (4 at first, more for a big claim). With other live holders around, it picks
//! among a wider set of old lanes at random, so that concurrent claimers mostly look at
//! different lanes. Ranking reads one index range per free lane and scanning a few lanes does
//! not, so the rest of a ranking is kept for the owner's next claims, for a second.
//!
//! The specification takes 4, 8 and 16 free lanes per round, oldest due first; this tuned
//! variant is listed among the README's differences from the specification, and
//! `tests/tests/specification.rs` checks that every lane taken is among the oldest
//! `round × spread` free ones.

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
    take::Hold,
};
use crate::{
    error::{Error, Result},
    store::mongo::{
        MongoEventStore,
        lane::{Lane, int},
        lease::RankedLanes,
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

/// `count` of the `ranked` lanes (oldest due delivery first). Alone, a claimer takes the oldest;
/// with others around it takes `count` at random among the oldest `count * spread`, so that
/// claimers running at the same time mostly pick different lanes.
fn choose(mut ranked: Vec<i32>, count: usize, spread: usize) -> Vec<i32> {
    if spread <= 1 || ranked.len() <= count {
        ranked.truncate(count);
        return ranked;
    }
    ranked.truncate(count.saturating_mul(spread));
    // The low bits of a UUID v7 are random.
    let mut state = uuid::Uuid::now_v7().as_u128() as u64 | 1;
    for i in 0..count {
        // xorshift64
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        let j = i + (state % (ranked.len() - i) as u64) as usize;
        ranked.swap(i, j);
    }
    ranked.truncate(count);
    ranked
}

/// The lanes of a kept ranking that are still free, in ranking order, with the time of the
/// ranking; `None` when it was for other handlers or is too old.
fn reusable(
    ranking: Option<RankedLanes>,
    handlers: &[&str],
    now: DateTime,
    free: &[i32],
) -> Option<(Vec<i32>, DateTime)> {
    let ranking = ranking?;
    let age = now
        .timestamp_millis()
        .checked_sub(ranking.at.timestamp_millis())?;
    if age < 0
        || age > RANKING_REUSE.as_millis() as i64
        || ranking.handlers.len() != handlers.len()
        || ranking.handlers.iter().zip(handlers).any(|(a, b)| a != b)
    {
        return None;
    }
    let lanes: Vec<i32> = ranking
        .lanes
        .into_iter()
        .filter(|lane| free.contains(lane))
        .collect();
    Some((lanes, ranking.at))
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
        contenders: usize,
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
        let spread = contenders.clamp(1, MAX_SPREAD);
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
            let (ranked, ranked_at) = match kept {
                Some((kept, at)) if kept.len() >= round || complete => (kept, at),
                _ if complete => break,
                _ => {
                    let (ranked, seen_all) = self
                        .rank_lanes(&free_ids, handlers, now, round.saturating_mul(spread))
                        .await?;
                    complete = seen_all;
                    (ranked, now)
                }
            };
            if ranked.is_empty() {
                break;
            }
            let chosen = choose(ranked.clone(), round, spread);
            let rest: Vec<i32> = ranked
                .into_iter()
                .filter(|lane| !chosen.contains(lane))
                .collect();
            *ranking = (!rest.is_empty()).then(|| RankedLanes {
                handlers: handlers.iter().map(|h| (*h).to_owned()).collect(),
                at: ranked_at,
                lanes: rest,
            });
            tried.extend(chosen.iter().copied());
            let scanned = self.join_lanes(&chosen, &free, lanes, request).await?;
            self.scan_lanes(&scanned, handlers, now, scan).await?;
            round = round.saturating_mul(2);
        }
        Ok(())
    }

    /// The `free` lanes with due deliveries of `handlers` that the oldest entries of the claim
    /// index show (enough to find `count` lanes, unless a few lanes hold all the oldest work),
    /// the lane with the oldest due delivery first; and whether these are all the `free` lanes
    /// with due deliveries (the queries read fewer entries than they could).
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
        let queries = free.chunks(LANES_PER_QUERY).map(|group| async move {
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
        let mut oldest: HashMap<i32, DateTime> = HashMap::new();
        let mut seen_all = true;
        for (docs, all) in future::try_join_all(queries).await? {
            seen_all &= all;
            for doc in docs {
                let (Some(lane), Ok(due)) =
                    (int(&doc, field::LANE_ID), doc.get_datetime(field::DUE_AT))
                else {
                    continue;
                };
                let Ok(lane) = i32::try_from(lane) else {
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
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_kept_ranking_serves_the_same_handlers_for_a_second_and_only_free_lanes() {
        let at = DateTime::from_millis(10_000);
        let kept = || {
            Some(RankedLanes {
                handlers: vec!["a".into(), "b".into()],
                at,
                lanes: vec![5, 3, 9],
            })
        };
        let later = |ms: i64| DateTime::from_millis(10_000 + ms);
        assert_eq!(
            reusable(kept(), &["a", "b"], later(1_000), &[9, 5, 7]),
            Some((vec![5, 9], at))
        );
        assert_eq!(reusable(kept(), &["a", "b"], later(1_001), &[5]), None);
        assert_eq!(reusable(kept(), &["a", "b"], later(-1), &[5]), None);
        assert_eq!(reusable(kept(), &["a"], later(0), &[5]), None);
        assert_eq!(reusable(kept(), &["b", "a"], later(0), &[5]), None);
        assert_eq!(reusable(None, &["a", "b"], later(0), &[5]), None);
    }

    #[test]
    fn alone_a_claimer_takes_the_oldest_lanes_and_with_others_some_of_the_oldest() {
        let ranked: Vec<i32> = (0..40).collect();
        assert_eq!(choose(ranked.clone(), 4, 1), vec![0, 1, 2, 3]);
        assert_eq!(choose(vec![5, 6], 4, 8), vec![5, 6]);
        for _ in 0..20 {
            let mut chosen = choose(ranked.clone(), 4, 3);
            assert_eq!(chosen.len(), 4);
            assert!(
                chosen.iter().all(|lane| (0..12).contains(lane)),
                "{chosen:?}"
            );
            chosen.sort_unstable();
            chosen.dedup();
            assert_eq!(chosen.len(), 4);
        }
    }
}
