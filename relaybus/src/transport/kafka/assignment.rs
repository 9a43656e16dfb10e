//! Sharing a topic's partitions among the processes of one consumer, through leads of the local
//! store (rskafka has no consumer groups).
//!
//! Every process of a consumer (one name, one topic, one database) holds a member lead of its
//! own and a lead per partition it reads, all renewed every third of the
//! [lease](super::KafkaConsumerBuilder::lease). Each round it lists the consumer's leads: the
//! members alive, and the partitions the others read. The partitions the broker's metadata lists
//! are shared out evenly: ranked by their member role, the first `partitions % members` take one
//! more than the rest. A process keeps the partitions it reads up to its share, gives up those
//! beyond it (its reader stops after its batch, then the lead is resigned), and takes free ones
//! below it. A partition moves only when the members change; the partitions of a process that
//! died are free once its leads expired, so another takes them within a lease and a third.
//!
//! The leads fence the readers: each append's transaction keeps the reader's lead first
//! ([`keep_lead`](crate::store::Leadership::keep_lead)), so a reader that lost its lead (paused past the lease, say)
//! appends nothing more and stops; the new reader goes on from the offset stored with the last
//! append that committed.

use std::{
    collections::{HashMap, HashSet},
    future::Future,
    time::Duration,
};

use tokio::{sync::mpsc, task::JoinHandle, time::Instant};
use tokio_util::sync::CancellationToken;

use super::{KafkaConsumer, partition::PartitionReader};
use crate::{
    bus::RelayBus,
    event::fnv1a64,
    store::{Lead, MAX_ROLE_BYTES, Store},
    transport::{
        BatchReport,
        inbound::{self, Fence},
    },
};

/// The longest readable role prefix: room is left for a member id (`m` and 32 hexadecimal
/// digits) within [`MAX_ROLE_BYTES`].
const MAX_READABLE_PREFIX: usize = MAX_ROLE_BYTES - 33;

/// The start of the roles of a consumer's leads: `kafka/<topic>/<name>/`, or, when that is too
/// long for a role, `kafka#<64-bit hash of the two>/`. A topic has no `/`, and what follows the
/// prefix in a role has none either, so the roles of one consumer never pass for another's.
pub(super) fn role_prefix(topic: &str, name: &str) -> String {
    let readable = format!("kafka/{topic}/{name}/");
    if readable.len() <= MAX_READABLE_PREFIX && !readable.chars().any(char::is_control) {
        return readable;
    }
    let joined = serde_json::json!([topic, name]).to_string();
    format!("kafka#{:016x}/", fnv1a64(joined.as_bytes()))
}

/// What a role of the consumer names, from what follows its prefix.
#[derive(Debug, PartialEq, Eq)]
enum Role {
    /// A process of the consumer: `m<id>`.
    Member,
    /// A partition read: `p<partition>`.
    Partition(u32),
}

fn parse_role(rest: &str) -> Option<Role> {
    if let Some(partition) = rest.strip_prefix('p') {
        return partition
            .bytes()
            .all(|b| b.is_ascii_digit())
            .then(|| partition.parse().ok().map(Role::Partition))
            .flatten();
    }
    let id = rest.strip_prefix('m')?;
    (!id.is_empty() && id.bytes().all(|b| b.is_ascii_hexdigit())).then_some(Role::Member)
}

/// How many partitions the member ranked `rank` of `members` reads: an even share, one more for
/// the first `partitions % members`.
fn share(partitions: usize, members: usize, rank: usize) -> usize {
    let members = members.max(1);
    partitions / members + usize::from(rank < partitions % members)
}

/// A partition read by this process: its reader's task, and the token that stops it.
struct Reader {
    /// Which of the partition's readers in this run it is.
    id: u64,
    stop: CancellationToken,
    task: JoinHandle<BatchReport>,
}

/// Tells the run that a reader's task ended, when the task returns or unwinds.
struct Ended {
    partition: u32,
    id: u64,
    to: mpsc::UnboundedSender<(u32, u64)>,
}

impl Drop for Ended {
    fn drop(&mut self) {
        let _ = self.to.send((self.partition, self.id));
    }
}

/// One run of a consumer that shares its partitions: the readers it runs and its leads.
pub(super) struct Assignment<S: Store> {
    consumer: KafkaConsumer,
    bus: RelayBus<S>,
    shutdown: CancellationToken,
    lease: Duration,
    prefix: String,
    member: String,
    /// The partitions the broker's metadata listed last.
    partitions: Vec<u32>,
    readers: HashMap<u32, Reader>,
    /// The id of the next reader started.
    next_id: u64,
    /// Each reader's task sends its partition and id here when it ends.
    ended_to: mpsc::UnboundedSender<(u32, u64)>,
    ended: mpsc::UnboundedReceiver<(u32, u64)>,
    total: BatchReport,
}

impl<S: Store> Assignment<S> {
    pub(super) fn new(
        consumer: &KafkaConsumer,
        bus: &RelayBus<S>,
        shutdown: CancellationToken,
    ) -> Self {
        let inner = &consumer.inner;
        let prefix = role_prefix(&inner.topic, &inner.name);
        let member = format!("{prefix}m{}", uuid::Uuid::now_v7().simple());
        let (ended_to, ended) = mpsc::unbounded_channel();
        Assignment {
            consumer: consumer.clone(),
            bus: bus.clone(),
            shutdown,
            lease: inner.lease,
            prefix,
            member,
            partitions: Vec::new(),
            readers: HashMap::new(),
            next_id: 0,
            ended_to,
            ended,
            total: BatchReport::default(),
        }
    }

    /// Runs rounds every third of the lease until shutdown, then stops every reader (each
    /// finishes its batch) and resigns every lead. Returns every batch's report added up.
    pub(super) async fn run(mut self) -> BatchReport {
        let round = self.lease / 3;
        let mut next = Instant::now();
        loop {
            tokio::select! {
                biased;
                () = self.shutdown.cancelled() => break,
                Some((partition, id)) = self.ended.recv() => self.reap(partition, id).await,
                () = tokio::time::sleep_until(next) => {
                    let shutdown = self.shutdown.clone();
                    tokio::select! {
                        () = shutdown.cancelled() => break,
                        () = self.round() => {}
                    }
                    next = Instant::now() + round;
                }
            }
        }
        let partitions: Vec<u32> = self.readers.keys().copied().collect();
        for partition in &partitions {
            if let Some(reader) = self.readers.remove(partition) {
                reader.stop.cancel();
                self.join(reader).await;
            }
        }
        self.publish();
        for partition in partitions {
            let role = self.role(partition);
            self.resign(&role).await;
        }
        let member = self.member.clone();
        self.resign(&member).await;
        self.total.next_offset = None;
        self.total
    }

    /// One round: discovers the partitions, renews the leads, and gives up or takes partitions
    /// towards this process's share.
    async fn round(&mut self) {
        match self.consumer.discover_partitions().await {
            Ok(partitions) => self.partitions = partitions,
            Err(error) => {
                tracing::warn!(%error, "listing the topic's partitions failed; trying again");
            }
        }
        let store = self.bus.store().clone();
        let lease = self.lease;
        if let Err(error) = self.bounded(store.lead(&self.member, lease)).await {
            tracing::warn!(%error, role = self.member, "renewing the consumer's member lead failed");
        }
        let mut held: Vec<u32> = self.readers.keys().copied().collect();
        held.sort_unstable();
        for partition in held {
            let role = self.role(partition);
            match self.bounded(store.lead(&role, lease)).await {
                Ok(true) => {}
                Ok(false) => {
                    tracing::warn!(role, "another process took the partition over");
                    self.stop(partition).await;
                }
                // The append's fence guards the partition meanwhile.
                Err(error) => tracing::warn!(%error, role, "renewing a partition's lead failed"),
            }
        }
        let leads = match self.bounded(store.leads(&self.prefix)).await {
            Ok(leads) => leads,
            Err(error) => {
                tracing::warn!(%error, "listing the consumer's leads failed; trying again");
                return;
            }
        };
        let (wanted, taken) = self.wanted(&leads);
        while self.readers.len() > wanted {
            let Some(&partition) = self.readers.keys().max() else {
                break;
            };
            self.stop(partition).await;
            let role = self.role(partition);
            self.resign(&role).await;
        }
        for partition in self.free(&taken) {
            if self.readers.len() >= wanted {
                break;
            }
            let role = self.role(partition);
            match self.bounded(store.lead(&role, lease)).await {
                Ok(true) => self.start(partition),
                Ok(false) => {}
                Err(error) => tracing::warn!(%error, role, "taking a partition's lead failed"),
            }
        }
    }

    /// This process's share of the partitions, by its rank among the members listed, and the
    /// partitions other processes read.
    fn wanted(&self, leads: &[Lead]) -> (usize, HashSet<u32>) {
        let mut members = Vec::new();
        let mut taken = HashSet::new();
        for lead in leads {
            let Some(rest) = lead.role.strip_prefix(&self.prefix) else {
                continue;
            };
            match parse_role(rest) {
                Some(Role::Member) => members.push(lead.role.as_str()),
                Some(Role::Partition(partition)) if !lead.ours => {
                    taken.insert(partition);
                }
                _ => {}
            }
        }
        // Not listed when its renewal failed: it counts all the same.
        if !members.contains(&self.member.as_str()) {
            members.push(&self.member);
        }
        members.sort_unstable();
        let rank = members
            .iter()
            .position(|member| *member == self.member)
            .unwrap_or(0);
        (share(self.partitions.len(), members.len(), rank), taken)
    }

    /// The partitions nobody reads, from a place of this member's own in the list, so that
    /// processes taking partitions at once mostly try different ones.
    fn free(&self, taken: &HashSet<u32>) -> Vec<u32> {
        let count = self.partitions.len();
        if count == 0 {
            return Vec::new();
        }
        let start = fnv1a64(self.member.as_bytes()) as usize % count;
        (0..count)
            .map(|at| self.partitions[(start + at) % count])
            .filter(|partition| !taken.contains(partition) && !self.readers.contains_key(partition))
            .collect()
    }

    /// Starts reading `partition`, whose lead this process took.
    fn start(&mut self, partition: u32) {
        let stop = self.shutdown.child_token();
        let fence = Fence {
            role: self.role(partition),
            period: self.lease,
            lost: stop.clone(),
        };
        let reader = PartitionReader::new(&self.consumer, &self.bus, partition, Some(fence));
        let bus = self.bus.clone();
        let id = self.next_id;
        self.next_id += 1;
        let ended = Ended {
            partition,
            id,
            to: self.ended_to.clone(),
        };
        let token = stop.clone();
        let task = tokio::spawn(async move {
            let _ended = ended;
            inbound::run(&reader, &bus, token).await
        });
        tracing::info!(
            partition,
            topic = self.consumer.topic(),
            "reading a partition"
        );
        self.readers.insert(partition, Reader { id, stop, task });
        self.publish();
    }

    /// Stops the reader of `partition` and waits for it to finish its batch.
    async fn stop(&mut self, partition: u32) {
        if let Some(reader) = self.readers.remove(&partition) {
            reader.stop.cancel();
            self.publish();
            self.join(reader).await;
            tracing::info!(
                partition,
                topic = self.consumer.topic(),
                "stopped reading a partition"
            );
        }
    }

    /// Reader `id` of `partition` ended: by itself when it is still listed (its lead was lost,
    /// or it failed), and then it is reaped.
    async fn reap(&mut self, partition: u32, id: u64) {
        if self
            .readers
            .get(&partition)
            .is_some_and(|reader| reader.id == id)
        {
            self.stop(partition).await;
        }
    }

    async fn join(&mut self, reader: Reader) {
        match reader.task.await {
            Ok(report) => self.total.add(report),
            Err(error) => {
                tracing::error!(%error, "a partition reader of the Kafka consumer failed")
            }
        }
    }

    async fn resign(&self, role: &str) {
        let store = self.bus.store().clone();
        if let Err(error) = self.bounded(store.resign(role)).await {
            tracing::warn!(%error, role, "resigning a lead failed; it expires by itself");
        }
    }

    /// A store call, failed when it takes longer than a lease (a lead it waits for, held by a
    /// transaction of a process that died, say).
    async fn bounded<T>(
        &self,
        call: impl Future<Output = crate::Result<T>>,
    ) -> Result<T, crate::Error> {
        match tokio::time::timeout(self.lease, call).await {
            Ok(result) => result,
            Err(_) => Err(crate::Error::custom(format!(
                "the store did not answer within the lease ({:?})",
                self.lease
            ))),
        }
    }

    fn role(&self, partition: u32) -> String {
        format!("{}p{partition}", self.prefix)
    }

    /// Tells [`KafkaConsumer::assignment`]'s receivers what this process reads now.
    fn publish(&self) {
        let mut reading: Vec<u32> = self.readers.keys().copied().collect();
        reading.sort_unstable();
        self.consumer.inner.assignment.send_if_modified(|current| {
            let changed = *current != reading;
            *current = reading;
            changed
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_add_up_to_the_partitions() {
        for partitions in 0..10 {
            for members in 1..6 {
                let total: usize = (0..members)
                    .map(|rank| share(partitions, members, rank))
                    .sum();
                assert_eq!(total, partitions, "{partitions} over {members}");
            }
        }
        assert_eq!(share(4, 2, 0), 2);
        assert_eq!(share(4, 3, 0), 2);
        assert_eq!(share(4, 3, 2), 1);
    }

    #[test]
    fn roles_name_one_consumer() {
        let prefix = role_prefix("orders", "shipping");
        assert_eq!(prefix, "kafka/orders/shipping/");
        assert_eq!(parse_role("p12"), Some(Role::Partition(12)));
        assert_eq!(parse_role("m0190abcdef"), Some(Role::Member));
        // A consumer named `shipping/x` has roles under this prefix too; they name nothing here.
        assert_eq!(parse_role("x/p1"), None);
        assert_eq!(parse_role("p"), None);
        assert_eq!(parse_role("p-1"), None);
        let long = role_prefix(&"t".repeat(200), "shipping");
        assert!(
            long.starts_with("kafka#") && long.len() + 33 <= MAX_ROLE_BYTES,
            "{long}"
        );
        assert_ne!(long, role_prefix(&"t".repeat(200), "billing"));
    }
}
