//! sha256 digests in their OCI spelling (`sha256:<hex>`).

use std::io::{self, Read};

use sha2::{Digest, Sha256};

/// Formats the digest of `bytes` as `sha256:<hex>`.
pub(crate) fn sha256(bytes: &[u8]) -> String {
    format!("sha256:{}", hex::encode(Sha256::digest(bytes)))
}

/// Returns the hex part of a well-formed `sha256:<64 lowercase hex>` digest.
///
/// Digests come from untrusted manifests and become path components, so
/// anything else is refused.
pub(crate) fn sha256_hex(digest: &str) -> Option<&str> {
    let hex = digest.strip_prefix("sha256:")?;
    let well_formed = hex.len() == 64
        && hex
            .bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    well_formed.then_some(hex)
}

/// A reader that hashes everything read through it.
pub(crate) struct HashingReader<R> {
    inner: R,
    hasher: Sha256,
}

impl<R: Read> HashingReader<R> {
    pub(crate) fn new(inner: R) -> Self {
        HashingReader {
            inner,
            hasher: Sha256::new(),
        }
    }

    /// Reads the rest of the stream so the digest covers all of it.
    pub(crate) fn drain(&mut self) -> io::Result<()> {
        io::copy(self, &mut io::sink()).map(drop)
    }

    /// The digest of what has been read so far.
    pub(crate) fn digest(&self) -> String {
        format!("sha256:{}", hex::encode(self.hasher.clone().finalize()))
    }
}

impl<R: Read> Read for HashingReader<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.hasher.update(&buf[..n]);
        Ok(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_well_formed_sha256_digests_pass() {
        let good = sha256(b"x");
        assert!(sha256_hex(&good).is_some());
        assert!(sha256_hex("sha256:../../etc").is_none());
        assert!(sha256_hex(&good.to_uppercase()).is_none());
        assert!(sha256_hex(&good.replace("sha256", "sha512")).is_none());
    }
}
