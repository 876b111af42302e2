//! The data plane's wire format (see the module doc of `dataplane`): the request line, the
//! reply line, frame headers, and the checks both ends make on them.

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufRead, AsyncBufReadExt};

/// The protocol version this agent speaks; a request of another is refused.
pub const VERSION: u32 = 1;
/// The longest request or reply line, newline included.
pub const MAX_LINE: usize = 64 << 10;
/// The most ranges one request may name (a restore asks for whole files or a few pieces).
pub const MAX_RANGES: usize = 1024;
/// The most payload bytes one frame carries.
pub const FRAME_MAX: u32 = 1 << 20;
/// `offset u64 LE | len u32 LE | crc32c u32 LE`.
pub const FRAME_HEADER_BYTES: usize = 16;

/// How the bytes travel once the reply line is sent.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// Frames on the request's own TCP connection.
    #[default]
    Tcp,
    /// RDMA, set up over the connection (`checkpoints::rdma`, cargo feature `rdma`).
    Rdma,
}

/// Which file: the job, the launch (generation) that wrote it, the step, its name in the step
/// directory.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct FileKey {
    pub job: i64,
    pub generation: i64,
    pub step: u64,
    pub file: String,
}

impl std::fmt::Display for FileKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} (job {} generation {} step {})", self.file, self.job, self.generation, self.step)
    }
}

/// The request line a client sends.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Request {
    pub v: u32,
    /// What lets this client read the file (`motley_server::capability`; the file's
    /// `RestoreFile.capability`). Never the agent's own token: a request line seen on the wire
    /// gives nothing beyond this file until the capability expires.
    #[serde(default)]
    pub capability: Option<String>,
    pub job: i64,
    pub generation: i64,
    pub step: u64,
    pub file: String,
    /// `[offset, len]` pairs, served in this order.
    pub ranges: Vec<(u64, u64)>,
    /// The flow's planned rate; `null`: as fast as the server's own pacers allow.
    #[serde(default)]
    pub rate_bytes_s: Option<f64>,
    #[serde(default)]
    pub transport: Transport,
}

impl Request {
    pub fn key(&self) -> FileKey {
        FileKey { job: self.job, generation: self.generation, step: self.step, file: self.file.clone() }
    }

    /// Parses a request line: the version first, so that a peer of another version is told
    /// so rather than that its fields are wrong.
    pub fn parse(line: &str) -> Result<Request, String> {
        let value: serde_json::Value = serde_json::from_str(line).map_err(|e| format!("request is not JSON: {e}"))?;
        Request::version(&value)?;
        serde_json::from_value(value).map_err(|e| format!("request: {e}"))
    }

    /// Whether a request line's `v` is this agent's version.
    fn version(value: &serde_json::Value) -> Result<(), String> {
        match value.get("v").and_then(|v| v.as_u64()) {
            Some(v) if v == u64::from(VERSION) => Ok(()),
            v => {
                let v = v.map_or_else(|| "absent".to_string(), |v| v.to_string());
                Err(format!(
                    "unknown protocol version {v}: this agent speaks data plane version {VERSION}; run agents of one Motley version"
                ))
            }
        }
    }
}

/// A probe's request line: `{"v":1,"probe":{"bytes":N},"capability":"TOKEN"}`
/// (`dataplane::probe`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProbeRequest {
    pub v: u32,
    pub probe: ProbeAsk,
    /// A probe token naming the probed node (`motley_server::capability::mint_probe`).
    #[serde(default)]
    pub capability: Option<String>,
}

/// What a probe asks for: `bytes` payload bytes (0: the reply line only, a round trip).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProbeAsk {
    pub bytes: u64,
}

/// A request line: a fetch of a file's ranges, or a probe.
#[derive(Clone, Debug, PartialEq)]
pub enum Asked {
    Fetch(Request),
    Probe(ProbeRequest),
}

impl Asked {
    /// Parses a request line (the version first, as `Request::parse`): a probe is a line with
    /// a `probe` field.
    pub fn parse(line: &str) -> Result<Asked, String> {
        let value: serde_json::Value = serde_json::from_str(line).map_err(|e| format!("request is not JSON: {e}"))?;
        if value.get("probe").is_none() {
            return Request::parse(line).map(Asked::Fetch);
        }
        Request::version(&value)?;
        serde_json::from_value(value).map(Asked::Probe).map_err(|e| format!("probe request: {e}"))
    }
}

/// The reply line: `{"ok":true,"bytes":LEN}` or `{"ok":false,"error":"..."}`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Reply {
    pub ok: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

impl Reply {
    pub fn ok(bytes: u64) -> Reply {
        Reply { ok: true, bytes: Some(bytes), error: None }
    }
    pub fn error(message: impl Into<String>) -> Reply {
        Reply { ok: false, bytes: None, error: Some(message.into()) }
    }
}

/// One line of JSON, newline-terminated.
pub fn line<T: Serialize>(value: &T) -> Vec<u8> {
    // Serializing these plain structs cannot fail; an empty object keeps the peer's parser honest if it did.
    let mut out = serde_json::to_vec(value).unwrap_or_else(|_| b"{}".to_vec());
    out.push(b'\n');
    out
}

/// Reads one line of at most `MAX_LINE` bytes; `Ok(None)` at end of stream before any byte.
pub async fn read_line(reader: &mut (impl AsyncBufRead + Unpin)) -> std::io::Result<Option<String>> {
    use tokio::io::AsyncReadExt;
    let mut buf = Vec::new();
    reader.take(MAX_LINE as u64).read_until(b'\n', &mut buf).await?;
    if buf.is_empty() {
        return Ok(None);
    }
    if buf.last() != Some(&b'\n') {
        let why = if buf.len() >= MAX_LINE { format!("longer than {MAX_LINE} bytes") } else { "cut short".into() };
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, format!("line {why}")));
    }
    buf.pop();
    String::from_utf8(buf).map(Some).map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "line is not UTF-8"))
}

/// A frame's header; a frame of `len` 0 ends the stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FrameHeader {
    pub offset: u64,
    pub len: u32,
    pub crc32c: u32,
}

impl FrameHeader {
    /// The frame that ends the stream.
    pub const END: FrameHeader = FrameHeader { offset: 0, len: 0, crc32c: 0 };

    pub fn for_payload(offset: u64, payload: &[u8]) -> FrameHeader {
        FrameHeader { offset, len: payload.len() as u32, crc32c: crc32c::crc32c(payload) }
    }

    pub fn to_bytes(self) -> [u8; FRAME_HEADER_BYTES] {
        let mut b = [0u8; FRAME_HEADER_BYTES];
        b[..8].copy_from_slice(&self.offset.to_le_bytes());
        b[8..12].copy_from_slice(&self.len.to_le_bytes());
        b[12..].copy_from_slice(&self.crc32c.to_le_bytes());
        b
    }

    pub fn from_bytes(b: &[u8; FRAME_HEADER_BYTES]) -> FrameHeader {
        let [o0, o1, o2, o3, o4, o5, o6, o7, l0, l1, l2, l3, c0, c1, c2, c3] = *b;
        FrameHeader {
            offset: u64::from_le_bytes([o0, o1, o2, o3, o4, o5, o6, o7]),
            len: u32::from_le_bytes([l0, l1, l2, l3]),
            crc32c: u32::from_le_bytes([c0, c1, c2, c3]),
        }
    }
}

/// Checks ranges before any byte moves: at most `MAX_RANGES`, none empty, none overlapping
/// another (each byte arrives once), and, given the file's length, none beyond it.
pub fn check_ranges(ranges: &[(u64, u64)], file_len: Option<u64>) -> Result<(), String> {
    if ranges.len() > MAX_RANGES {
        return Err(format!("{} ranges in one request, at most {MAX_RANGES}; ask for fewer, larger ranges", ranges.len()));
    }
    let mut sorted = Vec::with_capacity(ranges.len());
    for &(offset, len) in ranges {
        let Some(end) = offset.checked_add(len) else {
            return Err(format!("range [{offset}, +{len}) overflows"));
        };
        if len == 0 {
            return Err(format!("range at {offset} is empty"));
        }
        if let Some(file_len) = file_len {
            if end > file_len {
                return Err(format!("range [{offset}, {end}) is beyond the file's length of {file_len} bytes"));
            }
        }
        sorted.push((offset, end));
    }
    sorted.sort_unstable();
    for w in sorted.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(format!("ranges [{}, {}) and [{}, {}) overlap", w[0].0, w[0].1, w[1].0, w[1].1));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_beyond_the_file_empty_or_overlapping_are_refused() {
        assert_eq!(check_ranges(&[(0, 10), (20, 5), (10, 10)], Some(25)), Ok(()));
        assert!(check_ranges(&[(20, 6)], Some(25)).unwrap_err().contains("beyond the file's length of 25 bytes"));
        assert!(check_ranges(&[(3, 0)], None).unwrap_err().contains("empty"));
        assert!(check_ranges(&[(0, 10), (9, 2)], None).unwrap_err().contains("overlap"));
        assert!(check_ranges(&[(u64::MAX, 2)], None).unwrap_err().contains("overflows"));
        let many: Vec<_> = (0..=MAX_RANGES as u64).map(|i| (i, 1)).collect();
        assert!(check_ranges(&many, None).unwrap_err().contains("at most"));
    }

    #[test]
    fn frame_headers_round_trip_little_endian() {
        let h = FrameHeader::for_payload(0x0102_0304_0506_0708, b"abc");
        let b = h.to_bytes();
        assert_eq!(&b[..8], &[8, 7, 6, 5, 4, 3, 2, 1]);
        assert_eq!(&b[8..12], &[3, 0, 0, 0]);
        assert_eq!(FrameHeader::from_bytes(&b), h);
        assert_eq!(h.crc32c, crc32c::crc32c(b"abc"));
    }

    #[test]
    fn requests_of_another_version_are_named_as_such() {
        let err = Request::parse(r#"{"v":2,"whatever":1}"#).unwrap_err();
        assert!(err.contains("unknown protocol version 2"), "{err}");
        let err = Request::parse(r#"{"job":1}"#).unwrap_err();
        assert!(err.contains("unknown protocol version absent"), "{err}");
        let r = Request::parse(
            r#"{"v":1,"capability":"c","job":1,"generation":2,"step":3,"file":"manifest.json","ranges":[[0,5]],"rate_bytes_s":null,"transport":"tcp"}"#,
        )
        .unwrap();
        assert_eq!((r.ranges.clone(), r.transport, r.capability.as_deref()), (vec![(0, 5)], Transport::Tcp, Some("c")));
        // The wire has no token: a request line never carries the agent's own credential.
        let line = String::from_utf8(line(&r)).unwrap();
        assert!(line.contains("\"capability\":\"c\"") && !line.contains("token"), "{line}");
    }

    #[test]
    fn a_line_with_a_probe_field_is_a_probe_and_any_other_a_fetch() {
        let probe = Asked::parse(r#"{"v":1,"probe":{"bytes":65536},"capability":"t"}"#).unwrap();
        let want = ProbeRequest { v: 1, probe: ProbeAsk { bytes: 65536 }, capability: Some("t".into()) };
        assert_eq!(probe, Asked::Probe(want.clone()));
        assert_eq!(String::from_utf8(line(&want)).unwrap(), "{\"v\":1,\"probe\":{\"bytes\":65536},\"capability\":\"t\"}\n");
        let fetch = r#"{"v":1,"job":1,"generation":2,"step":3,"file":"manifest.json","ranges":[[0,5]]}"#;
        assert!(matches!(Asked::parse(fetch).unwrap(), Asked::Fetch(r) if r.file == "manifest.json"));
        // A probe of another version, or one that also names a file, is refused.
        assert!(Asked::parse(r#"{"v":2,"probe":{"bytes":1}}"#).unwrap_err().contains("unknown protocol version 2"));
        assert!(Asked::parse(r#"{"v":1,"probe":{"bytes":1},"file":"x"}"#).unwrap_err().contains("unknown field"));
        assert!(Asked::parse(r#"{"v":1,"probe":{"bytes":-1}}"#).unwrap_err().contains("probe request"));
    }

    #[tokio::test]
    async fn a_line_longer_than_the_cap_is_refused() {
        let long = vec![b'x'; MAX_LINE + 10];
        let err = read_line(&mut &long[..]).await.unwrap_err();
        assert!(err.to_string().contains("longer than"), "{err}");
        assert_eq!(read_line(&mut &b"{}\nrest"[..]).await.unwrap().as_deref(), Some("{}"));
        assert_eq!(read_line(&mut &b""[..]).await.unwrap(), None);
    }
}
