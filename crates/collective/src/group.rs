//! The process group: rank 0 hosts the store, every rank joins a ring of TCP connections, and
//! the collectives run over the ring.

use std::io::Write;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::CollectiveError;
use crate::store::{StoreClient, StoreServer, is_timeout};
use crate::wire::{
    Hello, Role, WireError, accept_handshake, finish_handshake, read_exact, write_frame,
};
use crate::world::World;

/// Bytes per pipelined segment: small enough that the receiver reduces one segment while the
/// next is on the wire, large enough that per-segment overhead vanishes.
const SEGMENT_FLOATS: usize = 64 * 1024;

/// Breaks a group's links: see [`ProcessGroup::interrupter`].
#[derive(Debug)]
pub struct Interrupter {
    links: [TcpStream; 2],
}

impl Interrupter {
    pub fn interrupt(&self) {
        for link in &self.links {
            // Already closed by the peer: nothing left to break.
            let _ = link.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// A connected group of ranks.
pub struct ProcessGroup {
    rank: usize,
    world_size: usize,
    timeout: Duration,
    /// Connection to rank+1 (we send on it).
    next: Option<TcpStream>,
    /// Connection from rank-1 (we receive on it).
    prev: Option<TcpStream>,
    scratch: Vec<f32>,
    /// Sequence number of the next collective, checked by the receiver to catch desync.
    seq: u64,
    _store_server: Option<StoreServer>,
}

impl ProcessGroup {
    /// Joins the group described by `world`: rank 0 binds the store at its MASTER_PORT; every
    /// rank publishes a listening address, connects to its successor and accepts its predecessor.
    pub fn join(world: &World) -> Result<Self, CollectiveError> {
        let rank = world.rank as usize;
        let n = world.world_size as usize;
        if n == 1 {
            return Ok(Self::single(world.timeout));
        }
        let store_server = if rank == 0 {
            let addr: SocketAddr = ([0, 0, 0, 0], world.master_port).into();
            Some(StoreServer::bind(addr, &world.run_id, &world.token)?)
        } else {
            None
        };
        let hello = |role| Hello {
            role,
            run_id: world.run_id.clone(),
            token: world.token.clone(),
            rank: world.rank,
        };
        let mut store = StoreClient::connect(
            &world.master_addr,
            world.master_port,
            &hello(Role::StoreClient),
            world.timeout,
        )?;

        // Keys carry the restart round, so a restarted group never reads a previous round's
        // addresses.
        let key = |r: usize| format!("ring/{}/addr/{r}", world.restart_count);
        let listener = TcpListener::bind((store.local_ip()?, 0))?;
        store.set(&key(rank), listener.local_addr()?.to_string().as_bytes())?;

        let next_rank = (rank + 1) % n;
        let prev_rank = (rank + n - 1) % n;
        let published = store.get(&key(next_rank))?;
        let next_addr: SocketAddr = std::str::from_utf8(&published)
            .ok()
            .and_then(|a| a.parse().ok())
            .ok_or_else(|| {
                CollectiveError::Wire(WireError::Malformed(format!(
                    "rank {next_rank} published {:?}, not an ip:port address",
                    String::from_utf8_lossy(&published)
                )))
            })?;
        let mut next = crate::store::connect_with_retry(
            &next_addr.ip().to_string(),
            next_addr.port(),
            world.timeout,
        )?;
        configure(&next, world.timeout)?;
        // Everyone sends its hello before accepting, and reads the answer after: no cycle of
        // waits, whatever the order in which ranks arrive.
        write_frame(&mut next, &hello(Role::RingPeer).encode())?;
        let mut prev = accept_with_deadline(&listener, world.timeout)?;
        configure(&prev, world.timeout)?;
        let peer = accept_handshake(&mut prev, &world.run_id, &world.token, Role::RingPeer)?;
        if peer.rank as usize != prev_rank {
            return Err(CollectiveError::Refused(format!(
                "rank {} connected where rank {prev_rank} was expected",
                peer.rank
            )));
        }
        finish_handshake(&mut next)?;

        let mut group = ProcessGroup {
            rank,
            world_size: n,
            timeout: world.timeout,
            next: Some(next),
            prev: Some(prev),
            scratch: vec![0.0; SEGMENT_FLOATS],
            seq: 0,
            _store_server: store_server,
        };
        // Once every rank has passed this, nobody needs the store any more, so rank 0 may
        // finish (and drop it) whenever it likes.
        group.barrier()?;
        Ok(group)
    }

    fn single(timeout: Duration) -> Self {
        ProcessGroup {
            rank: 0,
            world_size: 1,
            timeout,
            next: None,
            prev: None,
            scratch: Vec::new(),
            seq: 0,
            _store_server: None,
        }
    }

    /// A handle that breaks this group's links from another thread: every collective under
    /// way or to come fails at once (as if the peers were lost). `None` for a group of one.
    pub fn interrupter(&self) -> Option<Interrupter> {
        let (Some(next), Some(prev)) = (&self.next, &self.prev) else {
            return None;
        };
        Some(Interrupter {
            links: [next.try_clone().ok()?, prev.try_clone().ok()?],
        })
    }

    pub fn rank(&self) -> usize {
        self.rank
    }

    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Sums `buf` element-wise across all ranks; every rank ends with the sum.
    /// Ring algorithm: reduce-scatter then all-gather, each step pipelined in segments.
    pub fn all_reduce_sum(&mut self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        let n = self.world_size;
        if n == 1 || buf.is_empty() {
            return Ok(());
        }
        let len = buf.len();
        let bounds = |i: usize| (i * len / n, (i + 1) * len / n);
        let r = self.rank;
        for step in 0..n - 1 {
            let send = bounds((r + n - step) % n);
            let recv = bounds((r + 2 * n - step - 1) % n);
            self.exchange(buf, send, recv, Combine::Add)?;
        }
        for step in 0..n - 1 {
            let send = bounds((r + n + 1 - step) % n);
            let recv = bounds((r + n - step) % n);
            self.exchange(buf, send, recv, Combine::Replace)?;
        }
        Ok(())
    }

    /// Averages `buf` across ranks.
    pub fn all_reduce_mean(&mut self, buf: &mut [f32]) -> Result<(), CollectiveError> {
        self.all_reduce_sum(buf)?;
        let scale = 1.0 / self.world_size as f32;
        buf.iter_mut().for_each(|x| *x *= scale);
        Ok(())
    }

    /// Copies `root`'s `buf` to every rank, forwarded along the ring segment by segment.
    pub fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CollectiveError> {
        self.broadcast_bytes(bytemuck::cast_slice_mut(buf), root)
    }

    /// Copies `root`'s bytes to every rank: integers and records travel exactly, not as floats.
    pub fn broadcast_bytes(&mut self, buf: &mut [u8], root: usize) -> Result<(), CollectiveError> {
        let n = self.world_size;
        if n == 1 {
            return Ok(());
        }
        let seq = self.next_seq();
        let forwards = (self.rank + 1) % n != root;
        let receives = self.rank != root;
        let timeout = self.timeout;
        let (Some(next), Some(prev)) = (self.next.as_mut(), self.prev.as_mut()) else {
            unreachable!("a group of more than one rank has both ring links");
        };
        if receives {
            recv_header(prev, seq, buf.len(), timeout, self.rank)?;
        }
        if forwards {
            send_header(next, seq, buf.len(), timeout, self.rank)?;
        }
        for segment in buf.chunks_mut(SEGMENT_FLOATS * size_of::<f32>()) {
            if receives {
                read_exact(prev, segment)
                    .map_err(|e| link_error(e, "receiving a broadcast", timeout, self.rank, -1))?;
            }
            if forwards {
                next.write_all(segment).map_err(|e| {
                    link_error(e.into(), "forwarding a broadcast", timeout, self.rank, 1)
                })?;
            }
        }
        Ok(())
    }

    /// Returns once every rank has called it.
    pub fn barrier(&mut self) -> Result<(), CollectiveError> {
        let mut token = [1.0f32];
        self.all_reduce_sum(&mut token)?;
        if token[0] as usize != self.world_size {
            return Err(CollectiveError::Wire(WireError::Malformed(format!(
                "barrier counted {} ranks, expected {}",
                token[0], self.world_size
            ))));
        }
        Ok(())
    }

    /// Every rank's `value`, in rank order: one small broadcast from each rank in turn (for a
    /// handful of integers once per regroup, not for data).
    pub fn all_gather_u64(&mut self, value: u64) -> Result<Vec<u64>, CollectiveError> {
        (0..self.world_size)
            .map(|root| {
                let mut word = if root == self.rank {
                    value.to_le_bytes()
                } else {
                    [0; 8]
                };
                self.broadcast_bytes(&mut word, root)?;
                Ok(u64::from_le_bytes(word))
            })
            .collect()
    }

    fn next_seq(&mut self) -> u64 {
        self.seq += 1;
        self.seq
    }

    /// One ring step: send `buf[send]` to the successor while receiving `buf[recv]` from the
    /// predecessor and combining it in place. The two ranges never overlap.
    fn exchange(
        &mut self,
        buf: &mut [f32],
        send: (usize, usize),
        recv: (usize, usize),
        combine: Combine,
    ) -> Result<(), CollectiveError> {
        let seq = self.next_seq();
        let (rank, timeout) = (self.rank, self.timeout);
        let (Some(next), Some(prev)) = (self.next.as_mut(), self.prev.as_mut()) else {
            unreachable!("a group of more than one rank has both ring links");
        };
        let (send_slice, recv_slice) = disjoint(buf, send, recv);
        let scratch = &mut self.scratch;
        std::thread::scope(|scope| {
            let sender = scope.spawn(move || -> Result<(), CollectiveError> {
                send_header(next, seq, send_slice.len(), timeout, rank)?;
                for segment in send_slice.chunks(SEGMENT_FLOATS) {
                    next.write_all(bytemuck::cast_slice(segment))
                        .map_err(|e| link_error(e.into(), "sending", timeout, rank, 1))?;
                }
                Ok(())
            });
            let received = (|| -> Result<(), CollectiveError> {
                recv_header(prev, seq, recv_slice.len(), timeout, rank)?;
                for segment in recv_slice.chunks_mut(SEGMENT_FLOATS) {
                    let incoming = &mut scratch[..segment.len()];
                    read_exact(prev, bytemuck::cast_slice_mut(incoming))
                        .map_err(|e| link_error(e, "receiving", timeout, rank, -1))?;
                    match combine {
                        Combine::Add => segment
                            .iter_mut()
                            .zip(incoming.iter())
                            .for_each(|(a, b)| *a += b),
                        Combine::Replace => segment.copy_from_slice(incoming),
                    }
                }
                Ok(())
            })();
            let sent = sender.join().unwrap_or_else(|_| {
                Err(CollectiveError::PeerLost(
                    "the sending thread panicked".into(),
                ))
            });
            received.and(sent)
        })
    }
}

#[derive(Clone, Copy)]
enum Combine {
    Add,
    Replace,
}

/// Splits `buf` into two disjoint mutable ranges.
fn disjoint(buf: &mut [f32], a: (usize, usize), b: (usize, usize)) -> (&[f32], &mut [f32]) {
    if a.1 <= b.0 {
        let (left, right) = buf.split_at_mut(b.0);
        (&left[a.0..a.1], &mut right[..b.1 - b.0])
    } else {
        // Chunks are contiguous and in order, so here `b` ends where `a` (or an empty chunk
        // before it) starts.
        let (left, right) = buf.split_at_mut(b.1);
        (&right[a.0 - b.1..a.1 - b.1], &mut left[b.0..])
    }
}

fn send_header(
    s: &mut TcpStream,
    seq: u64,
    len: usize,
    timeout: Duration,
    rank: usize,
) -> Result<(), CollectiveError> {
    let mut header = [0u8; 16];
    header[..8].copy_from_slice(&seq.to_le_bytes());
    header[8..].copy_from_slice(&(len as u64).to_le_bytes());
    s.write_all(&header)
        .map_err(|e| link_error(e.into(), "sending", timeout, rank, 1))
}

fn recv_header(
    s: &mut TcpStream,
    seq: u64,
    len: usize,
    timeout: Duration,
    rank: usize,
) -> Result<(), CollectiveError> {
    let mut header = [0u8; 16];
    read_exact(s, &mut header).map_err(|e| link_error(e, "receiving", timeout, rank, -1))?;
    let got_seq = u64::from_le_bytes(header[..8].try_into().unwrap_or_default());
    let got_len = u64::from_le_bytes(header[8..].try_into().unwrap_or_default());
    if got_seq != seq || got_len != len as u64 {
        return Err(CollectiveError::Desync(format!(
            "expected collective #{seq} of {len} elements, the peer sent #{got_seq} of {got_len}: ranks are calling different collectives"
        )));
    }
    Ok(())
}

fn link_error(
    e: WireError,
    doing: &str,
    timeout: Duration,
    rank: usize,
    dir: isize,
) -> CollectiveError {
    let peer = if dir > 0 { "successor" } else { "predecessor" };
    let who = format!("rank {rank}'s ring {peer} ({doing})");
    match e {
        WireError::Io(io) if is_timeout(&io) => CollectiveError::Timeout {
            what: who,
            after: timeout,
        },
        WireError::Truncated => CollectiveError::PeerLost(who),
        WireError::Io(io)
            if matches!(
                io.kind(),
                std::io::ErrorKind::ConnectionReset | std::io::ErrorKind::BrokenPipe
            ) =>
        {
            CollectiveError::PeerLost(who)
        }
        other => other.into(),
    }
}

fn configure(s: &TcpStream, timeout: Duration) -> Result<(), CollectiveError> {
    s.set_nonblocking(false)?;
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    Ok(())
}

fn accept_with_deadline(
    listener: &TcpListener,
    timeout: Duration,
) -> Result<TcpStream, CollectiveError> {
    listener.set_nonblocking(true)?;
    let deadline = Instant::now() + timeout;
    loop {
        match listener.accept() {
            Ok((stream, _)) => return Ok(stream),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(CollectiveError::Timeout {
                        what: "the ring predecessor to connect".into(),
                        after: timeout,
                    });
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            Err(e) => return Err(e.into()),
        }
    }
}
