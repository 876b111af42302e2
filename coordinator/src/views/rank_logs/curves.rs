//! The training curves of each (job, generation) as last read, so that a read fetches only what
//! rank 0 wrote since (the dashboard asks every few seconds per viewer; a log's tail is up to
//! [`super::CURVES_TAIL`] bytes and a job has up to [`super::CURVES_GENERATIONS`] of them).
//!
//! A [`Window`] is what a read of the log's tail would give (`LogRead::tail` then
//! `parse_generation`), kept up to date from the new bytes alone: the points and evaluations of
//! the lines in the tail, each with the offset its line starts at, so that lines the tail has
//! slid past are dropped; where every line starts (compactly: [`LineStarts`]), for the bytes
//! skipped; the line not ended yet. The tail starts after the first newline at or past
//! `size - CURVES_TAIL` (none skipped while the log is shorter): a line is in it iff it starts
//! after `size - CURVES_TAIL`. A log that shrank (rewritten) is read again from scratch. When
//! more than the tail was written since the last read, the first answer (one chunk from where
//! that read ended) goes unused, and the tail is read.
//!
//! [`CurvesCache`] keeps the windows, forgetting the least recently read beyond a memory budget.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use motley_contract::curves::{read_line, GenerationCurves, LineReading, StepPoint};

use super::LogRead;
use crate::error::CoordinatorError;

/// About this many bytes of windows are kept (their estimated size); the least recently read
/// go first. One window is kept whatever its size.
pub const CACHE_BYTES: usize = 64 << 20;

/// The offsets where lines start, in order, as gaps between them in LEB128 (a byte for a gap
/// under 128): never more bytes than the log they describe.
#[derive(Debug, Default)]
struct LineStarts {
    front: Option<u64>,
    back: u64,
    gaps: VecDeque<u8>,
}

impl LineStarts {
    fn push(&mut self, at: u64) {
        if self.front.is_none() {
            (self.front, self.back) = (Some(at), at);
            return;
        }
        let mut gap = at - self.back;
        self.back = at;
        loop {
            let low = (gap & 0x7f) as u8;
            gap >>= 7;
            if gap == 0 {
                self.gaps.push_back(low);
                break;
            }
            self.gaps.push_back(low | 0x80);
        }
    }

    /// The first start after `after`, those at or before it dropped.
    fn first_after(&mut self, after: u64) -> Option<u64> {
        while let Some(front) = self.front.filter(|f| *f <= after) {
            if self.gaps.is_empty() {
                self.front = None;
                break;
            }
            let (mut gap, mut shift) = (0u64, 0);
            while let Some(b) = self.gaps.pop_front() {
                gap |= u64::from(b & 0x7f) << shift;
                shift += 7;
                if b & 0x80 == 0 {
                    break;
                }
            }
            self.front = Some(front + gap);
        }
        self.front
    }
}

/// What a read of one log's tail gives, kept up to date (see the module's documentation).
#[derive(Debug, Default)]
pub struct Window {
    /// Bytes of the log taken in: the next read starts here.
    end: u64,
    /// Read at least once (a fresh window asks the log's size first).
    started: bool,
    /// Where the tail starts at most: lines starting at or before it are out (0: none is).
    cut: u64,
    /// Where `pending` starts, and the bytes of the line not ended yet.
    pending_at: u64,
    pending: Vec<u8>,
    /// Dropping the bytes of a line that started before the tail, up to its newline.
    skipping: bool,
    starts: LineStarts,
    /// Step -> its point and where the line that gave it starts.
    points: BTreeMap<i64, (StepPoint, u64)>,
    evals: BTreeMap<i64, (f64, u64)>,
    /// Where each line with a loss that was not finite starts (once per such loss).
    non_finite: VecDeque<u64>,
}

impl Window {
    /// Bring the window up to the log's current size, reading only bytes not read yet (or,
    /// when more than `tail` bytes are new, only the new tail). Blocking (`LogRead`).
    pub fn refresh(&mut self, log: &dyn LogRead, tail: u64) -> Result<(), CoordinatorError> {
        // A fresh window asks the size alone (an offset past the end answers no bytes): of a
        // log longer than the tail, only the tail is read.
        let (first, size) = log.chunk(if self.started { self.end } else { u64::MAX })?;
        let size = size.unwrap_or(0);
        if size < self.end {
            // Shorter than what was read: not the log read before. From scratch.
            *self = Window::default();
            return self.refresh(log, tail);
        }
        let cut = size.saturating_sub(tail);
        let mut next = Some(first);
        if !self.started || cut > self.end {
            // All that was read is before the tail: start at the tail, from its first newline.
            *self = Window { started: true, end: cut, pending_at: cut, skipping: cut > 0, ..Window::default() };
            next = None;
        }
        while self.end < size {
            let bytes = match next.take() {
                Some(b) => b,
                None => log.chunk(self.end)?.0,
            };
            if bytes.is_empty() {
                break; // it shrank meanwhile: the next refresh finds out
            }
            let take = bytes.len().min((size - self.end) as usize);
            self.feed(&bytes[..take]);
        }
        self.slide(cut);
        Ok(())
    }

    fn feed(&mut self, mut bytes: &[u8]) {
        while let Some(nl) = bytes.iter().position(|b| *b == b'\n') {
            let (line, rest) = (&bytes[..nl], &bytes[nl + 1..]);
            self.end += nl as u64 + 1;
            if self.skipping {
                self.skipping = false;
            } else if self.pending.is_empty() {
                self.take_line(line, self.pending_at);
            } else {
                let mut whole = std::mem::take(&mut self.pending);
                whole.extend_from_slice(line);
                self.take_line(&whole, self.pending_at);
            }
            self.pending_at = self.end;
            self.starts.push(self.end);
            bytes = rest;
        }
        self.end += bytes.len() as u64;
        if !self.skipping {
            self.pending.extend_from_slice(bytes);
        }
    }

    fn take_line(&mut self, line: &[u8], at: u64) {
        let r = read_line(&String::from_utf8_lossy(line));
        if let Some(p) = r.point {
            self.points.insert(p.step, (p, at));
        }
        if let Some(e) = r.eval {
            self.evals.insert(e.step, (e.eval_loss, at));
        }
        for _ in 0..r.non_finite {
            self.non_finite.push_back(at);
        }
    }

    /// Lines that start at or before `cut` are out of the tail from now on.
    fn slide(&mut self, cut: u64) {
        if cut <= self.cut {
            return;
        }
        self.cut = cut;
        self.points.retain(|_, (_, at)| *at > cut);
        self.evals.retain(|_, (_, at)| *at > cut);
        while self.non_finite.front().is_some_and(|at| *at <= cut) {
            self.non_finite.pop_front();
        }
        if self.pending_at <= cut && !self.skipping {
            // The line being written started before the tail: it never counts.
            self.pending.clear();
            self.skipping = true;
        }
    }

    /// The curves of generation `generation`, as `parse_generation` reads the tail.
    pub fn curves(&mut self, generation: i64) -> GenerationCurves {
        let skipped_bytes = if self.cut == 0 { 0 } else { self.starts.first_after(self.cut).unwrap_or(self.end).min(self.end) };
        let mut points: BTreeMap<i64, StepPoint> = self.points.iter().map(|(s, (p, _))| (*s, *p)).collect();
        let mut evals: BTreeMap<i64, f64> = self.evals.iter().map(|(s, (x, _))| (*s, *x)).collect();
        let mut non_finite = self.non_finite.len() as u64;
        // The last line, not ended yet, counts as it reads now (`str::lines` gives it too).
        if !self.skipping && !self.pending.is_empty() {
            let LineReading { point, eval, non_finite: bad } = read_line(&String::from_utf8_lossy(&self.pending));
            if let Some(p) = point {
                points.insert(p.step, p);
            }
            if let Some(e) = eval {
                evals.insert(e.step, e.eval_loss);
            }
            non_finite += bad;
        }
        GenerationCurves {
            generation,
            points: points.into_values().collect(),
            evals: evals.into_iter().map(|(step, eval_loss)| motley_contract::curves::EvalPoint { step, eval_loss }).collect(),
            non_finite,
            skipped_bytes,
            error: None,
        }
    }

    /// About how many bytes the window holds.
    fn weight(&self) -> usize {
        self.points.len() * 96 + self.evals.len() * 64 + self.non_finite.len() * 8 + self.starts.gaps.len() + self.pending.len()
    }
}

/// Which log a window reads: (job, generation, rank).
type LogKey = (i64, i64, i64);

/// The windows of the (job, generation, rank) logs read lately.
pub struct CurvesCache {
    slots: Mutex<HashMap<LogKey, Slot>>,
    /// Counts reads, for least-recently-read order.
    clock: std::sync::atomic::AtomicU64,
    /// About how many bytes of windows are kept ([`CACHE_BYTES`]).
    budget: usize,
}

impl Default for CurvesCache {
    fn default() -> Self {
        CurvesCache::with_budget(CACHE_BYTES)
    }
}

struct Slot {
    window: Arc<Mutex<Window>>,
    weight: usize,
    used: u64,
}

impl CurvesCache {
    /// A cache keeping about `budget` bytes of windows.
    pub fn with_budget(budget: usize) -> Self {
        CurvesCache { slots: Default::default(), clock: Default::default(), budget }
    }

    /// Generation `generation` of job `job`'s curves from `log` (its rank 0's log), reading
    /// only what is new since the last read. Blocking (`LogRead`); concurrent reads of one log
    /// wait for each other, so the second finds the first's bytes.
    pub fn read(&self, job: i64, generation: i64, log: &dyn LogRead, tail: u64) -> Result<GenerationCurves, CoordinatorError> {
        self.read_rank((job, generation, 0), log, tail)
    }

    /// The curves in the log of rank `key.2` of launch (`key.0`, `key.1`), as [`Self::read`]:
    /// after rank 0's replica is lost, the lines go on in the new leader's log.
    pub fn read_rank(&self, key: LogKey, log: &dyn LogRead, tail: u64) -> Result<GenerationCurves, CoordinatorError> {
        let (_, generation, _) = key;
        let used = self.clock.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let window = {
            let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
            let slot = slots.entry(key).or_insert_with(|| Slot { window: Default::default(), weight: 0, used });
            slot.used = used;
            slot.window.clone()
        };
        let mut w = window.lock().unwrap_or_else(|e| e.into_inner());
        let read = w.refresh(log, tail).map(|()| w.curves(generation));
        if read.is_err() {
            // Half-read bytes must not count twice: the next read starts over.
            *w = Window::default();
        }
        let weight = w.weight();
        drop(w);
        self.settle(key, weight);
        read
    }

    /// Record a window's size and forget the least recently read beyond the budget.
    fn settle(&self, key: LogKey, weight: usize) {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = slots.get_mut(&key) {
            s.weight = weight;
        }
        let mut total: usize = slots.values().map(|s| s.weight).sum();
        while total > self.budget && slots.len() > 1 {
            let Some((&oldest, _)) = slots.iter().filter(|(k, _)| **k != key).min_by_key(|(_, s)| s.used) else { break };
            total -= slots.remove(&oldest).map_or(0, |s| s.weight);
        }
    }

    /// How many windows are kept.
    pub fn len(&self) -> usize {
        self.slots.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU64, Ordering};

    use motley_contract::curves::parse_generation;

    use super::*;

    /// A log served as an agent serves it (`agent/src/logs/`: at most `chunk` bytes from an
    /// offset, and the size), counting the bytes it answers with.
    struct FakeLog {
        bytes: Mutex<Vec<u8>>,
        chunk: usize,
        served: AtomicU64,
    }

    impl FakeLog {
        fn new(chunk: usize) -> FakeLog {
            FakeLog { bytes: Mutex::default(), chunk, served: AtomicU64::new(0) }
        }
        fn append(&self, more: &[u8]) {
            self.bytes.lock().unwrap().extend_from_slice(more);
        }
        fn served(&self) -> u64 {
            self.served.load(Ordering::SeqCst)
        }
        /// What a read of the tail afresh gives (the curves before the cache).
        fn uncached(&self, generation: i64, tail: u64) -> GenerationCurves {
            let copy = FakeLog { bytes: Mutex::new(self.bytes.lock().unwrap().clone()), chunk: self.chunk, served: AtomicU64::new(0) };
            let (bytes, skipped) = copy.tail(tail).unwrap();
            GenerationCurves { skipped_bytes: skipped, ..parse_generation(generation, &String::from_utf8_lossy(&bytes)) }
        }
    }

    impl LogRead for FakeLog {
        fn chunk(&self, offset: u64) -> Result<(Vec<u8>, Option<u64>), CoordinatorError> {
            let b = self.bytes.lock().unwrap();
            let out: Vec<u8> = b.iter().skip(usize::try_from(offset).unwrap_or(usize::MAX)).take(self.chunk).copied().collect();
            self.served.fetch_add(out.len() as u64, Ordering::SeqCst);
            Ok((out, Some(b.len() as u64)))
        }
    }

    const TAIL: u64 = super::super::CURVES_TAIL;

    #[test]
    fn a_second_read_fetches_only_the_new_bytes_and_answers_as_a_fresh_read() {
        let (log, cache) = (FakeLog::new(7), CurvesCache::default());
        let first = "loading\n{\"step\": 1, \"loss\": 4.5, \"tokens_per_s\": 10, \"step_s\": 0.5}\n{\"step\": 2, \"loss\": NaN}\n";
        log.append(first.as_bytes());
        let read = cache.read(1, 1, &log, TAIL).unwrap();
        assert_eq!((read.points.len(), read.non_finite), (1, 1));
        assert_eq!(read, log.uncached(1, TAIL));
        assert_eq!(log.served(), first.len() as u64, "the first read fetches the log once");

        // A step printed again, an eval, and a line still being written (no newline yet).
        let more = "{\"step\": 1, \"loss\": 4.0}\n{\"step\": 2, \"eval_loss\": 3.5}\n{\"step\": 3, \"lo";
        log.append(more.as_bytes());
        let read = cache.read(1, 1, &log, TAIL).unwrap();
        assert_eq!(log.served(), (first.len() + more.len()) as u64, "only the new bytes");
        assert_eq!(read, log.uncached(1, TAIL));
        assert_eq!(read.points[0].loss, 4.0, "the later line of step 1 wins");

        let rest = "ss\": 3.0}\n";
        log.append(rest.as_bytes());
        let read = cache.read(1, 1, &log, TAIL).unwrap();
        assert_eq!(log.served(), (first.len() + more.len() + rest.len()) as u64);
        assert_eq!(read, log.uncached(1, TAIL));
        assert_eq!(read.points.iter().map(|p| p.step).collect::<Vec<_>>(), [1, 3]);

        let before = log.served();
        assert_eq!(cache.read(1, 1, &log, TAIL).unwrap(), read, "nothing new: the same answer");
        assert_eq!(log.served(), before, "and no byte fetched");
    }

    #[test]
    fn a_long_log_reads_only_its_tail_and_later_only_what_is_new() {
        let (log, cache, tail) = (FakeLog::new(16), CurvesCache::default(), 100u64);
        let line = |s: u64| format!("{{\"step\": {s}, \"loss\": {}.5}}\n", 100 - s);
        let mut step = 0;
        let mut grow = |n: u64| {
            let text: String = (0..n)
                .map(|_| {
                    step += 1;
                    line(step)
                })
                .collect();
            log.append(text.as_bytes());
            text.len() as u64
        };
        let size = grow(20);
        cache.read(1, 2, &log, tail).unwrap();
        assert_eq!(log.served(), tail, "a log longer than the tail: its tail only");
        for n in [1, 2, 3, 10, 1] {
            let (added, before) = (grow(n), log.served());
            let read = cache.read(1, 2, &log, tail).unwrap();
            // More than the tail new: the first answer, from where the last read ended, goes unused.
            let want = if added > tail { tail + 16 } else { added };
            assert_eq!(log.served() - before, want, "{n} lines");
            assert_eq!(read, log.uncached(2, tail));
            assert!(read.skipped_bytes > size - tail && !read.points.is_empty());
        }
    }

    /// xorshift64*: the same cases on every run.
    fn next(state: &mut u64) -> u64 {
        *state ^= *state >> 12;
        *state ^= *state << 25;
        *state ^= *state >> 27;
        state.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    #[test]
    fn any_log_grown_any_way_reads_as_its_tail_read_afresh() {
        let mut r = 0x9e37_79b9_7f4a_7c15u64;
        let kinds: [&dyn Fn(u64, u64) -> String; 9] = [
            &|s, x| format!("{{\"step\": {s}, \"loss\": {x}.25, \"tokens_per_s\": {x}, \"step_s\": 0.5}}\n"),
            &|s, _| format!("{{\"step\": {s}, \"loss\": NaN}}\n"),
            &|s, x| format!("{{\"step\": {s}, \"eval_loss\": {x}.0}}\r\n"),
            &|s, _| format!("{{\"step\": {s}, \"loss\": Infinity, \"eval_loss\": -Infinity}}\n"),
            &|_, _| "not json at all\n".into(),
            &|_, _| "\n".into(),
            &|s, _| format!("{{\"step\": {s}, \"loss\": 1.0, \"note\": \"caf\u{e9} \u{1f680}\"}}\n"),
            &|_, _| "\u{ff}\u{fe} bytes\n".into(),
            &|s, x| format!("  {{\"step\": {s}.0, \"loss\": {x}}}  \n"),
        ];
        for case in 0..60 {
            let tail = [1, 13, 64, 200, 1000, TAIL][case % 6];
            let (log, cache) = (FakeLog::new(1 + (next(&mut r) % 50) as usize), CurvesCache::default());
            let mut text: Vec<u8> = vec![];
            for _ in 0..40 {
                let kind = kinds[(next(&mut r) % kinds.len() as u64) as usize];
                text.extend(kind(next(&mut r) % 30, next(&mut r) % 9).into_bytes());
                if next(&mut r).is_multiple_of(10) {
                    text.extend([0xe2, 0x82]); // half a UTF-8 character
                }
            }
            let (mut at, mut read_size, mut started) = (0, 0u64, false);
            while at < text.len() {
                let upto = (at + 1 + (next(&mut r) % 90) as usize).min(text.len());
                log.append(&text[at..upto]);
                at = upto;
                let before = log.served();
                let read = cache.read(3, 1, &log, tail).unwrap();
                assert_eq!(read, log.uncached(1, tail), "case {case}, tail {tail}, {at} bytes");
                let new = upto as u64 - read_size;
                // Past the tail since the last read: the first answer (a chunk) goes unused.
                let want = if started && new > tail { tail + new.min(log.chunk as u64) } else { new.min(tail) };
                assert_eq!(log.served() - before, want, "case {case}: what is new, of the tail");
                (read_size, started) = (upto as u64, true);
                if next(&mut r).is_multiple_of(25) {
                    // The log rewritten shorter: read again from scratch.
                    let keep = (next(&mut r) % (upto as u64 + 1)) as usize;
                    log.bytes.lock().unwrap().truncate(keep);
                    assert_eq!(cache.read(3, 1, &log, tail).unwrap(), log.uncached(1, tail), "case {case}: shrunk to {keep}");
                    log.append(&text[keep..upto]);
                    read_size = keep as u64;
                }
            }
        }
    }

    #[test]
    fn readers_at_once_fetch_each_byte_once() {
        let (log, cache) = (FakeLog::new(5), CurvesCache::default());
        let text: String = (1..200).map(|s| format!("{{\"step\": {s}, \"loss\": 1.5}}\n")).collect();
        log.append(text.as_bytes());
        let reads: Vec<GenerationCurves> = std::thread::scope(|scope| {
            let handles: Vec<_> = (0..8).map(|_| scope.spawn(|| cache.read(1, 1, &log, TAIL).unwrap())).collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        assert!(reads.iter().all(|r| *r == log.uncached(1, TAIL) && r.points.len() == 199));
        assert_eq!(log.served(), text.len() as u64, "one reader fetched, the others found its bytes");
    }

    #[test]
    fn the_least_recently_read_windows_go_past_the_budget() {
        let cache = CurvesCache::with_budget(2000);
        let logs: Vec<FakeLog> = (0..4).map(|_| FakeLog::new(64)).collect();
        let text: String = (1..=10).map(|s| format!("{{\"step\": {s}, \"loss\": 1.5}}\n")).collect();
        for (g, log) in logs.iter().enumerate() {
            log.append(text.as_bytes());
            cache.read(1, g as i64, log, TAIL).unwrap();
        }
        // Ten points weigh about 1000 bytes: two windows fit.
        assert_eq!(cache.len(), 2);
        let before = logs[3].served();
        cache.read(1, 3, &logs[3], TAIL).unwrap();
        assert_eq!(logs[3].served(), before, "the newest window was kept");
        cache.read(1, 0, &logs[0], TAIL).unwrap();
        assert_eq!(logs[0].served(), 2 * text.len() as u64, "the oldest was forgotten: read again");
    }

    #[test]
    fn a_failed_read_starts_over_next_time() {
        struct Broken;
        impl LogRead for Broken {
            fn chunk(&self, _: u64) -> Result<(Vec<u8>, Option<u64>), CoordinatorError> {
                Err(CoordinatorError::Unavailable("node n0's agent: gone".into()))
            }
        }
        let (log, cache) = (FakeLog::new(8), CurvesCache::default());
        log.append(b"{\"step\": 1, \"loss\": 2.0}\n");
        cache.read(1, 1, &log, TAIL).unwrap();
        assert!(cache.read(1, 1, &Broken, TAIL).is_err());
        assert_eq!(cache.read(1, 1, &log, TAIL).unwrap(), log.uncached(1, TAIL));
    }

    #[test]
    fn line_starts_come_back_in_order_after_any_gap() {
        let mut s = LineStarts::default();
        let at = [3u64, 4, 130, 131, 20_000, 20_001, 5_000_000_000];
        for a in at {
            s.push(a);
        }
        assert_eq!(s.first_after(0), Some(3));
        assert_eq!(s.first_after(3), Some(4));
        assert_eq!(s.first_after(129), Some(130));
        assert_eq!(s.first_after(19_999), Some(20_000));
        assert_eq!(s.first_after(20_001), Some(5_000_000_000));
        assert_eq!(s.first_after(5_000_000_000), None);
    }
}
