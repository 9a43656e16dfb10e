//! Membership: the owners that claim from a database, and the lanes each one owns.
//!
//! Every owner that claims through a store instance is a member of the database while it keeps
//! claiming (30 s after its last claim) and until it relinquishes. Each instance lists its
//! members in one document of `<prefix>processes`, `members:<instance>`, with the handlers each
//! claims for and an expiry by the server's clock, written and read again every quarter of the
//! heartbeat expiry. A member's lanes follow from the list alone, by rendezvous hashing: lane
//! `l` belongs to the member with the highest score for `l`, so that a member joining or
//! leaving moves about one lane in N, and no coordinator or extra round trip is needed.
//!
//! A list names its process (host, process id, start time) as the crash-recovery heartbeat
//! does. When another process of the same host reads a list whose process is gone, it drops
//! the list and ends the leases of the lanes that instance held: a dead process runs nothing,
//! so its lanes need not wait out their lease (30 s by default) to run elsewhere. A process
//! that is only stopped, or runs on another host, keeps its lanes until their lease ends.
//!
//! The list is a preference, never a fence: two members that see different lists both try to
//! take a lane, and the lane document's conditional take lets one of them have it. Members
//! that claim for different handler sets own no lanes: a lane's holder claims for its own
//! handlers only, so each of them takes free lanes with work as the specification describes.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex, MutexGuard, Weak},
    time::{Duration, Instant},
};

use futures::TryStreamExt;
use mongodb::bson::{Bson, Document, doc, oid::ObjectId};

use crate::{
    error::Result,
    event::LANE_COUNT,
    store::mongo::{
        StoreInner,
        lane::strings,
        process::ProcessIdentity,
        schema::{field, path},
        sessions::gone,
    },
};

/// How long an owner counts as a member of its instance after its last claim.
const LOCAL_WINDOW: Duration = Duration::from_secs(30);

/// One member: an owner on a store instance, with the handlers it claims for (sorted).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Member {
    pub(crate) owner: String,
    pub(crate) instance: ObjectId,
    pub(crate) handlers: Vec<String>,
}

/// What one store instance knows of the members.
#[derive(Debug, Default)]
pub(crate) struct Members {
    /// This instance's members: handlers and last claim.
    local: Mutex<HashMap<String, (Vec<String>, Instant)>>,
    /// The other instances' members, as last read.
    remote: Mutex<Vec<Member>>,
    /// Grows with every change of the list this instance sees, so that a claim knows when its
    /// owner's lanes may have moved.
    generation: Mutex<u64>,
    /// Set once the beat runs.
    beat: tokio::sync::OnceCell<()>,
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Members {
    /// Notes that `owner` claims now for `handlers`; `true` when it was not a member before.
    pub(crate) fn note(&self, owner: &str, handlers: &[&str]) -> bool {
        let mut sorted: Vec<String> = handlers.iter().map(|h| (*h).to_owned()).collect();
        sorted.sort_unstable();
        let mut local = lock(&self.local);
        let now = Instant::now();
        let joined = match local.get_mut(owner) {
            Some((known, at)) => {
                let changed = *known != sorted || now.duration_since(*at) >= LOCAL_WINDOW;
                *known = sorted;
                *at = now;
                changed
            }
            None => {
                local.insert(owner.to_owned(), (sorted, now));
                true
            }
        };
        drop(local);
        if joined {
            self.changed();
        }
        joined
    }

    /// Forgets `owner`: it relinquished its lanes.
    pub(crate) fn forget(&self, owner: &str) {
        if lock(&self.local).remove(owner).is_some() {
            self.changed();
        }
    }

    /// Forgets what this instance read of the other instances' members, as a restart would.
    pub(crate) fn clear(&self) {
        lock(&self.remote).clear();
        self.changed();
    }

    /// Notes that lanes were handed back: owners of this instance that wait for them try to
    /// take them at their next claim.
    pub(crate) fn lanes_freed(&self) {
        self.changed();
    }

    fn changed(&self) {
        *lock(&self.generation) += 1;
    }

    /// A number that changes whenever the member list does, or lanes were handed back.
    pub(crate) fn generation(&self) -> u64 {
        *lock(&self.generation)
    }

    /// This instance's live members.
    fn local(&self, instance: ObjectId) -> Vec<Member> {
        let mut local = lock(&self.local);
        local.retain(|_, (_, at)| at.elapsed() < LOCAL_WINDOW);
        local
            .iter()
            .map(|(owner, (handlers, _))| Member {
                owner: owner.clone(),
                instance,
                handlers: handlers.clone(),
            })
            .collect()
    }

    /// Every live member: this instance's and the others' as last read.
    pub(crate) fn all(&self, instance: ObjectId) -> Vec<Member> {
        let mut all = self.local(instance);
        all.extend(
            lock(&self.remote)
                .iter()
                .filter(|member| member.instance != instance)
                .cloned(),
        );
        all
    }

    /// The lanes `owner` on `instance` owns, or `None` when the members claim for different
    /// handler sets (or `owner` is no member).
    pub(crate) fn lanes_of(&self, owner: &str, instance: ObjectId) -> Option<Vec<i32>> {
        assignment(&self.all(instance), owner, instance)
    }

    /// Starts the beat of this instance's list, once, and waits for its first write and read.
    pub(crate) async fn start(&self, store: &Arc<StoreInner>, expiry: Duration) {
        self.beat
            .get_or_init(|| async {
                if let Err(error) = beat(store, expiry).await {
                    tracing::warn!(%error, "relaybus could not write its member list");
                }
                tokio::spawn(beating(Arc::downgrade(store), expiry));
            })
            .await;
    }

    /// Writes this instance's list and reads the others' at once, for a member that just
    /// joined: the others learn of it at their next read.
    pub(crate) async fn announce(store: &Arc<StoreInner>, expiry: Duration) {
        if let Err(error) = beat(store, expiry).await {
            tracing::warn!(%error, "relaybus could not write its member list");
        }
    }
}

/// The `_id` of an instance's member list.
fn list_id(instance: ObjectId) -> String {
    format!("members:{instance}")
}

/// Writes this instance's member list with an expiry, and reads every live list.
async fn beat(store: &StoreInner, expiry: Duration) -> Result<()> {
    let instance = store.claims.instance;
    let members: Vec<Document> = store
        .members
        .local(instance)
        .into_iter()
        .map(|member| doc! { field::OWNER: member.owner, field::HANDLERS: member.handlers })
        .collect();
    let expiry_ms = i64::try_from(expiry.as_millis()).unwrap_or(i64::MAX);
    let mut set = doc! {
        field::MEMBERS: { "$literal": members },
        field::EXPIRES_AT: { "$add": ["$$NOW", expiry_ms] },
    };
    ProcessIdentity::stamp(&mut set);
    store
        .processes
        .update_one(
            doc! { field::ID: list_id(instance) },
            vec![doc! { "$set": set }],
        )
        .upsert(true)
        .await?;
    let lists: Vec<Document> = store
        .processes
        .find(doc! {
            field::ID: { "$regex": "^members:" },
            "$expr": { "$gt": [path::EXPIRES_AT, "$$NOW"] },
        })
        .await?
        .try_collect()
        .await?;
    let mut remote = Vec::new();
    let mut dead = Vec::new();
    for list in &lists {
        let Some(instance) = list
            .get_str(field::ID)
            .ok()
            .and_then(|id| id.strip_prefix("members:"))
            .and_then(|id| ObjectId::parse_str(id).ok())
        else {
            continue;
        };
        if gone(list) {
            dead.push(instance);
            continue;
        }
        let Ok(members) = list.get_array(field::MEMBERS) else {
            continue;
        };
        for member in members.iter().filter_map(Bson::as_document) {
            let Ok(owner) = member.get_str(field::OWNER) else {
                continue;
            };
            let mut handlers = strings(member, field::HANDLERS);
            handlers.sort_unstable();
            remote.push(Member {
                owner: owner.to_owned(),
                instance,
                handlers,
            });
        }
    }
    if !dead.is_empty() {
        free_lanes_of_dead(store, &dead).await?;
    }
    remote.sort_by(|a, b| (a.instance, &a.owner).cmp(&(b.instance, &b.owner)));
    let mut known = lock(&store.members.remote);
    if *known != remote {
        *known = remote;
        drop(known);
        store.members.changed();
    }
    Ok(())
}

/// Ends the leases of the lanes that `dead` instances, whose processes are gone, held, and
/// drops their lists. The lanes' in-flight claims are charged by their next taker, as after an
/// expired lease.
async fn free_lanes_of_dead(store: &StoreInner, dead: &[ObjectId]) -> Result<()> {
    let freed = store
        .lanes
        .update_many(
            doc! {
                field::INSTANCE: { "$in": dead },
                "$expr": { "$gt": [path::LEASE_EXPIRES_AT, "$$NOW"] },
            },
            vec![doc! { "$set": { field::LEASE_EXPIRES_AT: "$$NOW" } }],
        )
        .await?;
    let ids: Vec<String> = dead.iter().map(|instance| list_id(*instance)).collect();
    store
        .processes
        .delete_many(doc! { field::ID: { "$in": ids } })
        .await?;
    tracing::warn!(
        instances = dead.len(),
        lanes = freed.modified_count,
        "relaybus ended the lane leases of a process of this host that is gone"
    );
    Ok(())
}

/// Beats every quarter of `expiry` while the store instance lives, then deletes its list.
async fn beating(store: Weak<StoreInner>, expiry: Duration) {
    let interval = (expiry / 4).max(Duration::from_millis(50));
    let (processes, instance) = match store.upgrade() {
        Some(store) => (store.processes.clone(), store.claims.instance),
        None => return,
    };
    let mut ticks = tokio::time::interval(interval);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await;
    loop {
        ticks.tick().await;
        let Some(store) = store.upgrade() else {
            break;
        };
        if let Err(error) = beat(&store, expiry).await {
            tracing::warn!(%error, "relaybus could not renew its member list");
        }
    }
    let _ = processes
        .delete_one(doc! { field::ID: list_id(instance) })
        .await;
}

/// The lanes of `owner` on `instance` among `members`: those for which it scores highest.
/// `None` when it is not among them or the members claim for different handler sets.
pub(crate) fn assignment(members: &[Member], owner: &str, instance: ObjectId) -> Option<Vec<i32>> {
    let me = members
        .iter()
        .position(|member| member.owner == owner && member.instance == instance)?;
    if members
        .iter()
        .any(|member| member.handlers != members[me].handlers)
    {
        return None;
    }
    let seeds: Vec<u64> = members.iter().map(seed).collect();
    Some(
        (0..LANE_COUNT as i32)
            .filter(|&lane| {
                let best = seeds
                    .iter()
                    .enumerate()
                    .max_by_key(|(at, seed)| (score(**seed, lane), *at))
                    .map(|(at, _)| at);
                best == Some(me)
            })
            .collect(),
    )
}

/// A member's hash: FNV-1a (64 bits) of its instance and owner.
fn seed(member: &Member) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in member
        .instance
        .bytes()
        .iter()
        .chain(member.owner.as_bytes())
    {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

/// A member's score for a lane: its seed and the lane, mixed (the SplitMix64 finaliser).
fn score(seed: u64, lane: i32) -> u64 {
    let mut z = seed ^ (lane as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(owner: &str, instance: ObjectId) -> Member {
        Member {
            owner: owner.to_owned(),
            instance,
            handlers: vec!["h".to_owned()],
        }
    }

    #[test]
    fn every_lane_has_one_owner_and_shares_are_even() {
        let instance = ObjectId::new();
        let members: Vec<Member> = (0..4)
            .map(|i| member(&format!("bus-{i}"), instance))
            .collect();
        let mut owned = vec![0; 256];
        for m in &members {
            let lanes = assignment(&members, &m.owner, instance).unwrap();
            assert!((40..=90).contains(&lanes.len()), "{} lanes", lanes.len());
            for lane in lanes {
                owned[lane as usize] += 1;
            }
        }
        assert!(owned.iter().all(|n| *n == 1));
    }

    #[test]
    fn a_member_joining_moves_only_lanes_to_itself() {
        let instance = ObjectId::new();
        let three: Vec<Member> = (0..3)
            .map(|i| member(&format!("bus-{i}"), instance))
            .collect();
        let mut four = three.clone();
        four.push(member("bus-3", instance));
        for m in &three {
            let before = assignment(&three, &m.owner, instance).unwrap();
            let after = assignment(&four, &m.owner, instance).unwrap();
            assert!(after.iter().all(|lane| before.contains(lane)));
        }
        let moved = assignment(&four, "bus-3", instance).unwrap().len();
        assert!((30..=100).contains(&moved), "{moved} lanes moved");
    }

    #[test]
    fn members_of_different_handler_sets_own_nothing() {
        let instance = ObjectId::new();
        let mut other = member("b", instance);
        other.handlers = vec!["g".to_owned()];
        let members = vec![member("a", instance), other];
        assert_eq!(assignment(&members, "a", instance), None);
        assert_eq!(assignment(&members, "c", instance), None);
        assert_eq!(
            assignment(&members[..1], "a", instance).map(|lanes| lanes.len()),
            Some(256)
        );
    }
}
