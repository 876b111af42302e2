//! The RDMA path's control messages over the data plane's stream, TCP or TLS (what each side tells
//! the other, checked on arrival), and the READ pieces a transfer is cut into.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::CONTROL_MAX;
use crate::checkpoints::dataplane::Stream;
use crate::AgentError;

/// One side's queue pair, as the other needs it to address it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Endpoint {
    /// The RDMA device's name (for error messages on the other side).
    pub device: String,
    /// The QP number (24 bits).
    pub qpn: u32,
    /// The port's LID (InfiniBand addressing).
    pub lid: u16,
    /// The GID at `gid_index` (RoCE addressing; all zero when there is none).
    pub gid: [u8; 16],
    /// The first packet sequence number (24 bits).
    pub psn: u32,
    /// The port's active MTU as an `ibv_mtu` value (1 = 256 bytes ... 5 = 4096).
    pub mtu: u32,
    /// The port's link layer is Ethernet (RoCE: route by GID) rather than InfiniBand (by LID).
    pub roce: bool,
}

/// The holder's memory region over the file's bytes `[offset, offset + len)`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Region {
    /// The region's virtual address on the holder (the READs' remote address at `offset`).
    pub addr: u64,
    /// Its length in bytes.
    pub len: u64,
    /// The key that lets the peer READ it (and nothing else).
    pub rkey: u32,
    /// The file offset its first byte holds.
    pub offset: u64,
}

/// The control messages of the RDMA path, sent over the data plane's TCP stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "msg", rename_all = "snake_case", deny_unknown_fields)]
pub enum Control {
    /// Holder -> reader: its QP, the registered region and the ranges the reader may READ.
    Offer { endpoint: Endpoint, region: Region, ranges: Vec<(u64, u64)> },
    /// Reader -> holder: the reader's QP.
    Accept { endpoint: Endpoint },
    /// Holder -> reader: the holder's QP answers READs now. (A struct variant, so that unknown
    /// fields are refused as in the others.)
    Ready {},
    /// Reader -> holder: every range is read (this many bytes); the holder may deregister.
    Done { bytes: u64 },
    /// Either side: it cannot go on, and why.
    Error { message: String },
}

/// A control message as it goes over the stream: a 4-byte big-endian length, then JSON.
pub fn encode_control(msg: &Control) -> Vec<u8> {
    let body = serde_json::to_vec(msg).expect("control messages always serialize");
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(&body);
    frame
}

/// The message in `frame` (exactly one, as [`encode_control`] makes it), checked: the length
/// prefix matches, the JSON is a known message with no unknown field, PSNs and QP numbers fit in
/// 24 bits, the MTU is an `ibv_mtu`, and an offer's ranges are non-empty, do not overflow and lie
/// inside its region.
pub fn decode_control(frame: &[u8]) -> Result<Control, String> {
    let Some((prefix, body)) = frame.split_first_chunk::<4>() else {
        return Err(format!("control message of {} bytes is shorter than its 4-byte length prefix", frame.len()));
    };
    let len = u32::from_be_bytes(*prefix);
    if len > CONTROL_MAX {
        return Err(format!("control message claims {len} bytes, at most {CONTROL_MAX}"));
    }
    if body.len() != len as usize {
        return Err(format!("control message claims {len} bytes but has {}", body.len()));
    }
    let msg: Control = serde_json::from_slice(body).map_err(|e| format!("control message is not valid: {e}"))?;
    let check_endpoint = |e: &Endpoint| -> Result<(), String> {
        if e.qpn > 0xff_ffff || e.psn > 0xff_ffff {
            return Err(format!("QP number {} or PSN {} does not fit in 24 bits", e.qpn, e.psn));
        }
        if !(1..=5).contains(&e.mtu) {
            return Err(format!("MTU {} is not an ibv_mtu (1..=5)", e.mtu));
        }
        Ok(())
    };
    match &msg {
        Control::Offer { endpoint, region, ranges } => {
            check_endpoint(endpoint)?;
            if region.len == 0 || region.addr.checked_add(region.len).is_none() || region.offset.checked_add(region.len).is_none() {
                return Err(format!(
                    "region of {} bytes at {:#x} (file offset {}) is empty or overflows",
                    region.len, region.addr, region.offset
                ));
            }
            for &(offset, len) in ranges {
                let end = offset.checked_add(len);
                if len == 0 || offset < region.offset || end.is_none_or(|end| end > region.offset + region.len) {
                    return Err(format!(
                        "range (offset {offset}, length {len}) is empty or outside the region [{}, {})",
                        region.offset,
                        region.offset + region.len
                    ));
                }
            }
        }
        Control::Accept { endpoint } => check_endpoint(endpoint)?,
        Control::Ready {} | Control::Done { .. } | Control::Error { .. } => {}
    }
    Ok(msg)
}

/// The READ work requests for `ranges`: `(file offset, length)` pieces of at most `max` bytes
/// each, in order, covering every range exactly.
pub fn split_reads(ranges: &[(u64, u64)], max: u64) -> Vec<(u64, u32)> {
    assert!(max > 0 && max <= u64::from(u32::MAX), "a READ piece is 1..=u32::MAX bytes");
    let mut pieces = Vec::new();
    for &(offset, len) in ranges {
        let mut at = 0;
        while at < len {
            let n = (len - at).min(max);
            pieces.push((offset + at, n as u32));
            at += n;
        }
    }
    pieces
}

pub(super) async fn send(stream: &mut dyn Stream, msg: &Control) -> std::io::Result<()> {
    stream.write_all(&encode_control(msg)).await?;
    stream.flush().await
}

/// The peer's next control message, within `limit`.
pub(super) async fn recv(stream: &mut dyn Stream, limit: Duration) -> Result<Control, String> {
    let read = async {
        let mut frame = vec![0u8; 4];
        stream.read_exact(&mut frame).await.map_err(|e| format!("the peer closed the stream ({e})"))?;
        let len = u32::from_be_bytes([frame[0], frame[1], frame[2], frame[3]]);
        if len > CONTROL_MAX {
            return Err(format!("control message claims {len} bytes, at most {CONTROL_MAX}"));
        }
        frame.resize(4 + len as usize, 0);
        stream.read_exact(&mut frame[4..]).await.map_err(|e| format!("the peer closed the stream ({e})"))?;
        decode_control(&frame)
    };
    tokio::time::timeout(limit, read).await.map_err(|_| format!("the peer sent nothing for {}s", limit.as_secs()))?
}

/// Tells the peer why this side stops (best effort: it may be gone) and returns the error.
pub(super) async fn abort<T>(stream: &mut dyn Stream, err: AgentError) -> Result<T, AgentError> {
    let _ = send(stream, &Control::Error { message: err.to_string() }).await;
    Err(err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoints::rdma::PIECE;

    fn endpoint() -> Endpoint {
        Endpoint { device: "mlx5_0".into(), qpn: 0x1234, lid: 7, gid: [0xfe; 16], psn: 0xabcdef, mtu: 5, roce: true }
    }

    fn offer() -> Control {
        Control::Offer {
            endpoint: endpoint(),
            region: Region { addr: 0x7f00_0000_0000, len: 8 << 20, rkey: 0xdead, offset: 4096 },
            ranges: vec![(4096, 100), (1 << 20, 3 << 20)],
        }
    }

    fn frame(body: &str) -> Vec<u8> {
        let mut f = (body.len() as u32).to_be_bytes().to_vec();
        f.extend_from_slice(body.as_bytes());
        f
    }

    #[test]
    fn rdma_control_messages_round_trip() {
        for msg in [
            offer(),
            Control::Accept { endpoint: Endpoint { roce: false, gid: [0; 16], ..endpoint() } },
            Control::Ready {},
            Control::Done { bytes: u64::MAX },
            Control::Error { message: "no RDMA device \"x\"\n".into() },
        ] {
            let f = encode_control(&msg);
            assert_eq!(u32::from_be_bytes(f[..4].try_into().unwrap()) as usize, f.len() - 4);
            assert_eq!(decode_control(&f).unwrap(), msg);
        }
    }

    #[test]
    fn rdma_control_messages_reject_malformed_input() {
        let good = encode_control(&offer());
        let bad: Vec<(Vec<u8>, &str)> = vec![
            (vec![], "shorter than"),
            (vec![0, 0, 1], "shorter than"),
            (good[..good.len() - 1].to_vec(), "claims"),
            ([good.clone(), vec![b' ']].concat(), "claims"),
            ((CONTROL_MAX + 1).to_be_bytes().to_vec(), "at most"),
            (frame("not json"), "not valid"),
            (frame(r#"{"msg":"launch"}"#), "not valid"),
            (frame(r#"{"msg":"done"}"#), "not valid"),
            (frame(r#"{"msg":"done","bytes":-1}"#), "not valid"),
            (frame(r#"{"msg":"ready","extra":1}"#), "not valid"),
            (frame(r#"{"bytes":1}"#), "not valid"),
        ];
        for (f, why) in bad {
            let err = decode_control(&f).unwrap_err();
            assert!(err.contains(why), "{f:?}: {err}");
        }
        type Edit<'a> = &'a dyn Fn(&mut Endpoint, &mut Region, &mut Vec<(u64, u64)>);
        let with = |edit: Edit| {
            let Control::Offer { mut endpoint, mut region, mut ranges } = offer() else { unreachable!() };
            edit(&mut endpoint, &mut region, &mut ranges);
            decode_control(&encode_control(&Control::Offer { endpoint, region, ranges })).unwrap_err()
        };
        assert!(with(&|e, _, _| e.psn = 1 << 24).contains("24 bits"));
        assert!(with(&|e, _, _| e.qpn = u32::MAX).contains("24 bits"));
        assert!(with(&|e, _, _| e.mtu = 0).contains("ibv_mtu"));
        assert!(with(&|e, _, _| e.mtu = 6).contains("ibv_mtu"));
        assert!(with(&|_, r, _| r.len = 0).contains("empty or overflows"));
        assert!(with(&|_, r, _| r.addr = u64::MAX).contains("empty or overflows"));
        assert!(with(&|_, _, g| g.push((0, 10))).contains("outside the region"));
        assert!(with(&|_, _, g| g.push((8 << 20, 4097))).contains("outside the region"));
        assert!(with(&|_, _, g| g.push((5000, 0))).contains("empty"));
        assert!(with(&|_, _, g| g.push((u64::MAX, 2))).contains("outside the region"));
        let accept = Control::Accept { endpoint: Endpoint { psn: 1 << 24, ..endpoint() } };
        assert!(decode_control(&encode_control(&accept)).unwrap_err().contains("24 bits"));
    }

    #[test]
    fn rdma_split_reads_covers_ranges_in_pieces_of_at_most_a_mib() {
        assert!(split_reads(&[], PIECE).is_empty());
        assert_eq!(split_reads(&[(5, 1)], PIECE), vec![(5, 1)]);
        assert_eq!(split_reads(&[(0, PIECE)], PIECE), vec![(0, PIECE as u32)]);
        assert_eq!(split_reads(&[(0, PIECE + 1)], PIECE), vec![(0, PIECE as u32), (PIECE, 1)]);
        // Property-ish: many pseudo-random range lists (an LCG, so the run is reproducible).
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut rand = |n: u64| {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        for _ in 0..300 {
            let max = [1, 7, 4096, PIECE][rand(4) as usize];
            let mut ranges = Vec::new();
            let mut at = rand(1 << 30);
            for _ in 0..rand(6) {
                let len = 1 + rand(5 * PIECE);
                ranges.push((at, len));
                at += len + rand(3 * PIECE);
            }
            if max == 1 && ranges.iter().map(|r| r.1).sum::<u64>() > 2_000_000 {
                ranges.truncate(1);
                ranges.iter_mut().for_each(|r| r.1 = r.1.min(1000));
            }
            let pieces = split_reads(&ranges, max);
            let want: u64 = ranges.iter().map(|r| r.1.div_ceil(max)).sum();
            assert_eq!(pieces.len() as u64, want, "{ranges:?} by {max}");
            let mut it = pieces.iter().peekable();
            for &(offset, len) in &ranges {
                let mut covered = offset;
                while covered < offset + len {
                    let &(o, l) = it.next().expect("a piece for every byte");
                    assert_eq!(o, covered, "pieces are contiguous and in order");
                    assert!(l > 0 && u64::from(l) <= max, "piece of {l} bytes, max {max}");
                    covered += u64::from(l);
                }
                assert_eq!(covered, offset + len, "no piece crosses a range's end");
            }
            assert!(it.next().is_none());
        }
    }
}
