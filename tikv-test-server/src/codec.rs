//! The memcomparable byte encoding that PD uses for region boundaries of the transactional API.
//!
//! Keys travel raw in TiKV requests, but PD stores (and the transactional client expects and
//! sends) region boundaries in this encoding: groups of eight bytes, each followed by a marker byte `0xff - padding`.

const GROUP: usize = 8;
const MARKER: u8 = 0xff;

/// Encodes `key`. The empty boundary (minus or plus infinity) stays empty.
pub(crate) fn encode_boundary(key: &[u8]) -> Vec<u8> {
    if key.is_empty() {
        return Vec::new();
    }
    encode(key)
}

/// Encodes `key` in ascending memcomparable form.
pub(crate) fn encode(key: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity((key.len() / GROUP + 1) * (GROUP + 1));
    let mut index = 0;
    loop {
        let remain = key.len() - index;
        if remain >= GROUP {
            out.extend_from_slice(&key[index..index + GROUP]);
            out.push(MARKER);
            index += GROUP;
            continue;
        }
        let pad = GROUP - remain;
        out.extend_from_slice(&key[index..]);
        out.extend(std::iter::repeat_n(0u8, pad));
        out.push(MARKER - pad as u8);
        return out;
    }
}

/// Decodes a memcomparable key (what the client does with PD's boundaries; used by the tests to
/// check the encoding). An empty input decodes to the empty key; a malformed one is an error.
#[cfg(test)]
fn decode(data: &[u8]) -> Result<Vec<u8>, String> {
    if data.is_empty() {
        return Ok(Vec::new());
    }
    let mut out = Vec::with_capacity(data.len());
    let mut chunks = data.chunks(GROUP + 1);
    for chunk in chunks.by_ref() {
        if chunk.len() != GROUP + 1 {
            return Err(format!("truncated memcomparable key {data:?}"));
        }
        let marker = chunk[GROUP];
        let pad = (MARKER - marker) as usize;
        if pad == 0 {
            out.extend_from_slice(&chunk[..GROUP]);
            continue;
        }
        if pad > GROUP || chunk[GROUP - pad..GROUP].iter().any(|&b| b != 0) {
            return Err(format!("bad padding in memcomparable key {data:?}"));
        }
        out.extend_from_slice(&chunk[..GROUP - pad]);
        if chunks.next().is_some() {
            return Err(format!(
                "bytes after the last group of memcomparable key {data:?}"
            ));
        }
        return Ok(out);
    }
    Err(format!("memcomparable key {data:?} has no final group"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_keeps_order() {
        let keys: Vec<Vec<u8>> = vec![
            vec![],
            vec![0],
            vec![0, 0],
            b"a".to_vec(),
            b"abcdefg".to_vec(),
            b"abcdefgh".to_vec(),
            b"abcdefgh\0".to_vec(),
            b"abcdefghi".to_vec(),
            vec![0xff; 17],
        ];
        for key in &keys {
            assert_eq!(&decode(&encode(key)).unwrap(), key);
        }
        for pair in keys.windows(2) {
            assert!(pair[0] < pair[1]);
            assert!(
                encode(&pair[0]) < encode(&pair[1]),
                "{:?} vs {:?}",
                pair[0],
                pair[1]
            );
        }
        // The same bytes as tikv-client's encoder for a known key.
        assert_eq!(encode(b"abc"), vec![b'a', b'b', b'c', 0, 0, 0, 0, 0, 0xfa]);
        assert_eq!(encode(b""), vec![0, 0, 0, 0, 0, 0, 0, 0, 0xf7]);
        // A key of exactly one group is followed by an empty final group.
        let mut eight = b"abcdefgh".to_vec();
        eight.push(0xff);
        eight.extend_from_slice(&[0, 0, 0, 0, 0, 0, 0, 0, 0xf7]);
        assert_eq!(encode(b"abcdefgh"), eight);
        assert!(decode(&eight[..9]).is_err());
    }

    #[test]
    fn rejects_malformed_input() {
        assert!(decode(&[1, 2, 3]).is_err());
        assert!(decode(&[b'a', 0, 0, 0, 0, 0, 0, 1, 0xfa]).is_err());
        assert!(decode(&[b'a', 0, 0, 0, 0, 0, 0, 0, 0xff]).is_err());
    }
}
