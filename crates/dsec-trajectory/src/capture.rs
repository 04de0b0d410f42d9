//! Bounding one output stream as the log keeps it: the whole stream up to a bound, else
//! its head and tail around a marker line, and always its length and digest. The bound
//! holds while the command runs, so a command that prints gigabytes costs the edge no more
//! memory for the log than one that prints the bound.

use sha2::{Digest, Sha256};

/// One output stream as the log keeps it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct KeptOutput {
    /// The text kept: the whole stream, or its head, a marker line and its tail
    /// (UTF-8, invalid bytes replaced).
    pub text: String,
    /// Length of the whole stream in bytes, as the command wrote it.
    pub bytes: u64,
    /// `sha256:<hex>` of the whole stream's bytes.
    pub sha256: String,
    /// Bytes of the stream not kept; 0 when `text` is the whole stream.
    pub elided: u64,
}

impl KeptOutput {
    /// The line that stands for `elided` bytes the log did not keep.
    pub fn marker(elided: u64) -> String {
        format!("\n[... {elided} bytes not kept by the dsec trajectory log ...]\n")
    }
}

/// Collects one output stream, chunk by chunk, into a [`KeptOutput`].
pub struct OutputCapture {
    head_max: usize,
    tail_max: usize,
    head: Vec<u8>,
    /// The bytes past the head; trimmed to the last `tail_max` now and then.
    tail: Vec<u8>,
    bytes: u64,
    sha256: Sha256,
}

impl OutputCapture {
    /// A capture that keeps a stream of up to `keep` bytes whole, and of a longer one its
    /// first and last halves of `keep`.
    pub fn new(keep: u64) -> OutputCapture {
        let keep = usize::try_from(keep).unwrap_or(usize::MAX);
        OutputCapture {
            head_max: keep - keep / 2,
            tail_max: keep / 2,
            head: Vec::new(),
            tail: Vec::new(),
            bytes: 0,
            sha256: Sha256::new(),
        }
    }

    /// Adds the next chunk of the stream.
    pub fn push(&mut self, mut data: &[u8]) {
        self.bytes += data.len() as u64;
        self.sha256.update(data);
        let to_head = data.len().min(self.head_max - self.head.len());
        self.head.extend_from_slice(&data[..to_head]);
        data = &data[to_head..];
        self.tail.extend_from_slice(data);
        // Trimming only past twice the bound keeps the copying linear in the output.
        if self.tail.len() > 2 * self.tail_max.max(4096) {
            self.tail.drain(..self.tail.len() - self.tail_max);
        }
    }

    /// The stream as the log keeps it.
    pub fn finish(mut self) -> KeptOutput {
        let sha256 = format!("sha256:{}", hex::encode(self.sha256.finalize()));
        if self.bytes <= (self.head_max + self.tail_max) as u64 {
            self.head.append(&mut self.tail);
            return KeptOutput {
                text: String::from_utf8_lossy(&self.head).into_owned(),
                bytes: self.bytes,
                sha256,
                elided: 0,
            };
        }
        let tail = &self.tail[self.tail.len() - self.tail_max..];
        // Cut at character boundaries, so that the kept text has no replacement character
        // the command did not cause.
        let head = &self.head[..complete_utf8_len(&self.head)];
        let tail = &tail[tail
            .iter()
            .take(3)
            .take_while(|b| *b & 0xc0 == 0x80)
            .count()..];
        let elided = self.bytes - (head.len() + tail.len()) as u64;
        KeptOutput {
            text: format!(
                "{}{}{}",
                String::from_utf8_lossy(head),
                KeptOutput::marker(elided),
                String::from_utf8_lossy(tail)
            ),
            bytes: self.bytes,
            sha256,
            elided,
        }
    }
}

/// Length of `b` without a UTF-8 sequence cut short at its end.
fn complete_utf8_len(b: &[u8]) -> usize {
    (b.len().saturating_sub(3)..b.len())
        .find(|&i| {
            std::str::from_utf8(&b[i..])
                .is_err_and(|e| e.valid_up_to() == 0 && e.error_len().is_none())
        })
        .unwrap_or(b.len())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::digest;

    #[test]
    fn short_output_is_kept_whole_and_long_output_as_head_and_tail() {
        let mut short = OutputCapture::new(10);
        short.push(b"0123");
        short.push(b"456789");
        let short = short.finish();
        assert_eq!(
            (short.text.as_str(), short.bytes, short.elided),
            ("0123456789", 10, 0)
        );
        assert_eq!(short.sha256, digest(b"0123456789"));

        let whole: Vec<u8> = (0..100_000u32)
            .flat_map(|i| i.to_le_bytes())
            .map(|b| b'a' + b % 26)
            .collect();
        let mut long = OutputCapture::new(1000);
        for chunk in whole.chunks(777) {
            long.push(chunk);
        }
        let long = long.finish();
        assert_eq!(long.bytes, whole.len() as u64);
        assert_eq!(long.sha256, digest(&whole));
        assert_eq!(long.elided, whole.len() as u64 - 1000);
        let (head, tail) = long
            .text
            .split_once(&KeptOutput::marker(long.elided))
            .unwrap();
        assert_eq!(head.as_bytes(), &whole[..500]);
        assert_eq!(tail.as_bytes(), &whole[whole.len() - 500..]);
    }

    #[test]
    fn a_stream_that_ends_where_the_tail_is_trimmed_is_still_cut() {
        let mut c = OutputCapture::new(8192);
        c.push(&[b'x'; 4096]);
        c.push(&[b'y'; 8193]);
        let kept = c.finish();
        assert_eq!((kept.bytes, kept.elided), (12289, 12289 - 8192));
        assert!(kept.text.starts_with(&"x".repeat(4096)));
        assert!(kept.text.ends_with(&"y".repeat(4096)));
    }

    #[test]
    fn cuts_fall_on_character_boundaries() {
        // "é" is two bytes: a cut after 5 bytes of head would split one.
        let text = "éééééééééééééééééééé".repeat(10);
        let mut c = OutputCapture::new(10);
        c.push(text.as_bytes());
        let kept = c.finish();
        assert!(!kept.text.contains('\u{fffd}'), "{:?}", kept.text);
        let (head, tail) = kept.text.split_once('\n').unwrap();
        assert_eq!(head, "éé");
        assert!(tail.ends_with("]\néé"), "{tail:?}");
        assert_eq!(kept.elided, text.len() as u64 - 8);
    }

    #[test]
    fn nothing_kept_is_only_lengths_and_digests() {
        let mut c = OutputCapture::new(0);
        c.push(b"abc");
        let kept = c.finish();
        assert_eq!(kept.text, KeptOutput::marker(3));
        assert_eq!((kept.bytes, kept.elided), (3, 3));
        assert_eq!(OutputCapture::new(0).finish().text, "");
    }
}
