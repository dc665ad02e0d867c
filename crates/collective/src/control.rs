//! The local channel between an elastic agent and a worker that can regroup in place: one
//! Unix socket pair per worker, the worker's end inherited as `TRAINCTL_CONTROL_FD`.
//!
//! The worker says it can regroup ([`ToAgent::Ready`]), that a peer was lost and it waits for
//! the next round ([`ToAgent::Lost`]), that it stopped at a step boundary for an assignment
//! ([`ToAgent::Paused`]), what a regroup cost ([`ToAgent::Regrouped`]) and that the job's
//! training is over ([`ToAgent::Finished`]: what it does before exiting needs no group). The agent hands it
//! the next round's membership ([`ToWorker::Assign`]: the torchrun environment it would have
//! been started with), which a worker still training takes at its next step boundary, or asks
//! it to leave its group at once ([`ToWorker::Abort`]: a node of the group is gone) or to
//! leave the job after the step under way ([`ToWorker::Leave`]: its node was asked to go).
//! A worker that never says `Ready` (any program but the built-in trainer) is stopped
//! and started again, as torchrun does. Messages are the wire's frames and checked codec: the
//! other end is local, but a broken one must not make this end panic or allocate at will.

use std::io::{self, Read};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use crate::wire::{Decoder, Encoder, WireError, write_frame};

/// The largest message either end accepts (an assignment is a few hundred bytes).
const MAX_MESSAGE: usize = 64 * 1024;

/// What a worker tells its agent.
#[derive(Debug, Clone, PartialEq)]
pub enum ToAgent {
    /// This worker regroups in place when its group changes.
    Ready,
    /// A collective failed (a peer is gone); the worker holds the last step it completed, at
    /// global step `step`, and waits for an assignment. `assignments` is which of its
    /// assignments made the group that failed (0: its first group): the agent tells a loss in
    /// the group it has just assigned from a stale one, in a group the worker was leaving (it
    /// had not read the assignment yet, or held it for the step's end).
    Lost {
        assignments: u64,
        step: u64,
        reason: String,
    },
    /// The worker stopped after global step `step` for an assignment that came while it
    /// trained.
    Paused { assignments: u64, step: u64 },
    /// The worker trains in its new group.
    Regrouped(Regrouped),
    /// The ranks found this worker's node a straggler (`slow`: it became one; otherwise it
    /// stopped being one), `report` saying by how much and why. The agent may evict the node
    /// (`trainctl run --stragglers evict`).
    Straggler { slow: bool, report: String },
    /// The job's training is over (every rank agreed on its last step): what the worker still
    /// does (rank 0 saving the model, an evaluation) needs no group, and it exits 0 next. The
    /// agent then neither regroups nor restarts it when a peer goes; it waits for it to exit.
    Finished,
}

/// What one regroup cost, as the worker saw it.
#[derive(Debug, Clone, PartialEq)]
pub struct Regrouped {
    pub world_size_before: u32,
    pub world_size: u32,
    pub rank: u32,
    /// The global step the new group goes on from.
    pub step: u64,
    /// Steps this worker had completed that the new group does not keep (always 0 today: the
    /// new group starts from the most advanced survivor).
    pub steps_dropped: u64,
    /// The state streamed from a peer to the ranks that lacked it (0 when all had it).
    pub bytes: u64,
    /// From the worker's leaving its old group to its new group's state being in place.
    pub seconds: f64,
    /// Whether this worker itself received the state.
    pub received: bool,
    /// The assignments the worker had been handed when it regrouped (its count of
    /// [`ToWorker::Assign`]): which round this report is of, when the agent handed it several
    /// while it regrouped.
    pub assignments: u64,
}

/// What an agent tells its worker.
#[derive(Debug, Clone, PartialEq)]
pub enum ToWorker {
    /// Leave the group now, dropping the step in flight (a node of the group is gone: its
    /// collectives would wait for the timeout), and wait for an assignment.
    Abort,
    /// The next round's membership: the worker environment, name and value. A worker still
    /// training finishes the step under way (all ranks agree on which) first.
    Assign(Vec<(String, String)>),
    /// This node is asked to go (SIGTERM) and the others go on without it: leave the group
    /// after the step under way (the worker raises the pause every rank then takes) and exit
    /// with `contract::exit::PREEMPTED`.
    Leave,
}

/// A message either end can send.
pub trait Message: Sized {
    fn encode(&self) -> Vec<u8>;
    fn decode(buf: &[u8]) -> Result<Self, WireError>;
}

impl Message for ToAgent {
    fn encode(&self) -> Vec<u8> {
        match self {
            ToAgent::Ready => Encoder::new().u8(0),
            ToAgent::Lost {
                assignments,
                step,
                reason,
            } => Encoder::new()
                .u8(1)
                .u64(*assignments)
                .u64(*step)
                .str(reason),
            ToAgent::Paused { assignments, step } => {
                Encoder::new().u8(2).u64(*assignments).u64(*step)
            }
            ToAgent::Regrouped(r) => Encoder::new()
                .u8(3)
                .u32(r.world_size_before)
                .u32(r.world_size)
                .u32(r.rank)
                .u64(r.step)
                .u64(r.steps_dropped)
                .u64(r.bytes)
                .u64(r.seconds.to_bits())
                .u8(r.received as u8)
                .u64(r.assignments),
            ToAgent::Straggler { slow, report } => Encoder::new().u8(4).u8(*slow as u8).str(report),
            ToAgent::Finished => Encoder::new().u8(5),
        }
        .finish()
    }

    fn decode(buf: &[u8]) -> Result<Self, WireError> {
        let mut d = Decoder::new(buf);
        let message = match d.u8("message kind")? {
            0 => ToAgent::Ready,
            1 => ToAgent::Lost {
                assignments: d.u64("assignments")?,
                step: d.u64("step")?,
                reason: d.string("reason")?,
            },
            2 => ToAgent::Paused {
                assignments: d.u64("assignments")?,
                step: d.u64("step")?,
            },
            3 => ToAgent::Regrouped(Regrouped {
                world_size_before: d.u32("old world size")?,
                world_size: d.u32("world size")?,
                rank: d.u32("rank")?,
                step: d.u64("step")?,
                steps_dropped: d.u64("steps dropped")?,
                bytes: d.u64("bytes")?,
                seconds: f64::from_bits(d.u64("seconds")?),
                received: d.u8("received")? != 0,
                assignments: d.u64("assignments")?,
            }),
            4 => ToAgent::Straggler {
                slow: d.u8("slow")? != 0,
                report: d.string("report")?,
            },
            5 => ToAgent::Finished,
            kind => return Err(WireError::Malformed(format!("unknown message kind {kind}"))),
        };
        d.end("worker message")?;
        Ok(message)
    }
}

impl Message for ToWorker {
    fn encode(&self) -> Vec<u8> {
        match self {
            ToWorker::Abort => Encoder::new().u8(2),
            ToWorker::Leave => Encoder::new().u8(3),
            ToWorker::Assign(env) => env
                .iter()
                .fold(Encoder::new().u8(1).u32(env.len() as u32), |e, (k, v)| {
                    e.str(k).str(v)
                }),
        }
        .finish()
    }

    fn decode(buf: &[u8]) -> Result<Self, WireError> {
        let mut d = Decoder::new(buf);
        let message = match d.u8("message kind")? {
            2 => ToWorker::Abort,
            3 => ToWorker::Leave,
            1 => {
                let n = d.u32("variables")? as usize;
                // Each variable takes at least its two length prefixes.
                if n > buf.len() / 8 {
                    return Err(WireError::Malformed(format!(
                        "{n} variables in a message of {} bytes",
                        buf.len()
                    )));
                }
                let mut env = Vec::with_capacity(n);
                for _ in 0..n {
                    env.push((d.string("name")?, d.string("value")?));
                }
                ToWorker::Assign(env)
            }
            kind => return Err(WireError::Malformed(format!("unknown message kind {kind}"))),
        };
        d.end("agent message")?;
        Ok(message)
    }
}

/// Why a message could not be had.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("the other end of the control channel closed it")]
    Closed,
    #[error("control channel: {0}")]
    Wire(#[from] WireError),
}

impl From<io::Error> for ControlError {
    fn from(e: io::Error) -> Self {
        ControlError::Wire(WireError::Io(e))
    }
}

/// One end of the channel.
#[derive(Debug)]
pub struct Channel {
    stream: UnixStream,
    /// Bytes read but not yet a whole message.
    pending: Vec<u8>,
}

impl Channel {
    /// A new channel: the agent's end, and the worker's end to be inherited.
    pub fn pair() -> io::Result<(Channel, OwnedFd)> {
        let (agent, worker) = UnixStream::pair()?;
        Ok((Channel::new(agent), worker.into()))
    }

    /// The worker's end, from the descriptor it inherited (duplicated: the inherited one is
    /// left as it is).
    pub fn from_fd(fd: i32) -> io::Result<Channel> {
        // SAFETY: only borrowed for the `dup`; a descriptor that is not open makes `dup` fail
        // with EBADF, which is returned.
        let owned = unsafe { BorrowedFd::borrow_raw(fd) }.try_clone_to_owned()?;
        let stream = UnixStream::from(owned);
        // A descriptor of another kind (a file, a pipe) is refused here, not misread later.
        stream.local_addr()?;
        Ok(Channel::new(stream))
    }

    /// A second handle on the same channel (one thread reads, another writes).
    pub fn try_clone(&self) -> io::Result<Channel> {
        Ok(Channel::new(self.stream.try_clone()?))
    }

    fn new(stream: UnixStream) -> Channel {
        Channel {
            stream,
            pending: Vec::new(),
        }
    }

    pub fn send(&mut self, message: &impl Message) -> Result<(), ControlError> {
        write_frame(&mut self.stream, &message.encode()).map_err(|e| match e {
            WireError::Io(e) if e.kind() == io::ErrorKind::BrokenPipe => ControlError::Closed,
            e => e.into(),
        })
    }

    /// The next message, waiting up to `wait` for it (zero: only what has already arrived);
    /// `Ok(None)` when none came.
    pub fn recv<M: Message>(&mut self, wait: Duration) -> Result<Option<M>, ControlError> {
        let deadline = Instant::now() + wait;
        loop {
            if let Some(frame) = self.take_frame()? {
                return M::decode(&frame).map(Some).map_err(Into::into);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                self.stream.set_nonblocking(true)?;
            } else {
                self.stream.set_nonblocking(false)?;
                self.stream.set_read_timeout(Some(left))?;
            }
            let mut chunk = [0u8; 4096];
            match self.stream.read(&mut chunk) {
                Ok(0) => return Err(ControlError::Closed),
                Ok(n) => self.pending.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    return Ok(None);
                }
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// A whole frame from `pending`, if one is there.
    fn take_frame(&mut self) -> Result<Option<Vec<u8>>, ControlError> {
        let Some(len) = self.pending.first_chunk::<4>() else {
            return Ok(None);
        };
        let len = u32::from_le_bytes(*len) as usize;
        if len > MAX_MESSAGE {
            return Err(WireError::TooLarge {
                len,
                limit: MAX_MESSAGE,
            }
            .into());
        }
        if self.pending.len() < 4 + len {
            return Ok(None);
        }
        let frame = self.pending[4..4 + len].to_vec();
        self.pending.drain(..4 + len);
        Ok(Some(frame))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn regrouped() -> Regrouped {
        Regrouped {
            world_size_before: 3,
            world_size: 2,
            rank: 1,
            step: 41,
            steps_dropped: 0,
            bytes: 1 << 20,
            seconds: 0.25,
            received: true,
            assignments: 2,
        }
    }

    #[test]
    fn every_message_crosses_the_channel_whole() {
        let (mut agent, worker) = Channel::pair().unwrap();
        let mut worker = Channel::new(UnixStream::from(worker));
        let to_agent = [
            ToAgent::Ready,
            ToAgent::Lost {
                assignments: 2,
                step: 7,
                reason: "rank 2 closed the link".into(),
            },
            ToAgent::Paused {
                assignments: 3,
                step: 9,
            },
            ToAgent::Regrouped(regrouped()),
            ToAgent::Straggler {
                slow: true,
                report: "node 2 (ranks 4-5) is 2.8× slower than the others: compute".into(),
            },
            ToAgent::Straggler {
                slow: false,
                report: String::new(),
            },
            ToAgent::Finished,
        ];
        for m in &to_agent {
            worker.send(m).unwrap();
        }
        for m in &to_agent {
            assert_eq!(
                agent.recv::<ToAgent>(Duration::ZERO).unwrap().as_ref(),
                Some(m)
            );
        }
        assert_eq!(agent.recv::<ToAgent>(Duration::ZERO).unwrap(), None);
        let assign = ToWorker::Assign(vec![("RANK".into(), "1".into()), ("X".into(), "".into())]);
        agent.send(&ToWorker::Abort).unwrap();
        agent.send(&assign).unwrap();
        agent.send(&ToWorker::Leave).unwrap();
        assert_eq!(
            worker.recv::<ToWorker>(Duration::from_secs(1)).unwrap(),
            Some(ToWorker::Abort)
        );
        assert_eq!(
            worker.recv::<ToWorker>(Duration::from_secs(1)).unwrap(),
            Some(assign)
        );
        assert_eq!(
            worker.recv::<ToWorker>(Duration::from_secs(1)).unwrap(),
            Some(ToWorker::Leave)
        );
        drop(agent);
        assert!(matches!(
            worker.recv::<ToWorker>(Duration::from_secs(1)),
            Err(ControlError::Closed)
        ));
    }

    #[test]
    fn a_message_split_across_reads_is_put_back_together() {
        let (mut agent, worker) = Channel::pair().unwrap();
        let mut raw = UnixStream::from(worker);
        let mut frame = Vec::new();
        let paused = ToAgent::Paused {
            assignments: 0,
            step: 3,
        };
        write_frame(&mut frame, &paused.encode()).unwrap();
        use std::io::Write;
        raw.write_all(&frame[..3]).unwrap();
        assert_eq!(agent.recv::<ToAgent>(Duration::ZERO).unwrap(), None);
        raw.write_all(&frame[3..]).unwrap();
        assert_eq!(
            agent.recv::<ToAgent>(Duration::from_secs(1)).unwrap(),
            Some(paused)
        );
    }

    #[test]
    fn a_descriptor_that_is_not_a_socket_is_refused() {
        let file = std::fs::File::open("/proc/self/status").unwrap();
        use std::os::fd::AsRawFd;
        assert!(Channel::from_fd(file.as_raw_fd()).is_err());
    }

    proptest! {
        #[test]
        fn arbitrary_bytes_never_panic_the_decoders(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
            let _ = ToAgent::decode(&bytes);
            let _ = ToWorker::decode(&bytes);
        }

        #[test]
        fn assignments_round_trip(env in prop::collection::vec((".{0,20}", ".{0,40}"), 0..20)) {
            let m = ToWorker::Assign(env);
            prop_assert_eq!(ToWorker::decode(&m.encode()).unwrap(), m);
        }
    }
}
