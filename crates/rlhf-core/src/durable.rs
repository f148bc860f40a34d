//! Files that survive a crash and prove they are intact: atomic writes (temporary name,
//! fsync, rename, fsync of the directory), directories published by one rename once every
//! file in them is on disk, and a manifest of every file's size and content hash that is
//! checked before anything is loaded from it. Checkpoints are written and read through here:
//! a crash mid-save leaves the previous checkpoint as it was, and a file changed after the
//! save (a zeroed weight file, a truncated copy) is refused by name instead of loaded.
//! A manifest names only plain files of its own directory, and every file of the directory
//! must be listed: a manifest cannot point a load at `/proc`, a device, a FIFO or a link.
//! Who wrote a checkpoint is `seal.rs`'s concern.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::Read;
use std::path::{Path, PathBuf};

use rlhf_types::Checksum;
use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// The manifest's file name inside a published directory.
pub const MANIFEST_FILE: &str = "manifest.json";
/// Largest manifest read (a directory of a few thousand files fits in far less).
pub const MAX_MANIFEST_BYTES: u64 = 16 << 20;

/// Opens `path` for reading only if it is a regular file, without following a link and
/// without blocking on a FIFO or a device.
pub fn open_regular(path: &Path) -> std::io::Result<File> {
    use std::os::unix::fs::OpenOptionsExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path)?;
    if !f.metadata()?.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file",
        ));
    }
    Ok(f)
}

/// Reads a regular file (see [`open_regular`]) of at most `max` bytes.
pub fn read_regular(path: &Path, max: u64) -> Result<Vec<u8>> {
    let f = open_regular(path).map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    let mut out = Vec::new();
    f.take(max + 1)
        .read_to_end(&mut out)
        .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    if out.len() as u64 > max {
        return Err(Error::invalid(format!(
            "{} is larger than {max} bytes",
            path.display()
        )));
    }
    Ok(out)
}

/// Lower-case hex of `b` (digests and tags).
pub(crate) fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Whether `name` is a plain file name a manifest may list: not empty, no path separator,
/// not `.` or `..`, not the manifest itself.
fn plain_name(name: &str) -> bool {
    !name.is_empty()
        && name != "."
        && name != ".."
        && name != MANIFEST_FILE
        && !name.contains(['/', '\\', '\0'])
}

/// Flushes a file or directory to stable storage.
pub fn sync_path(path: &Path) -> Result<()> {
    File::open(path)
        .and_then(|f| f.sync_all())
        .map_err(|e| Error::io(format!("syncing {} to disk", path.display()), e))
}

/// Writes `bytes` to `path` so that a crash leaves either the old file or the new one:
/// a temporary name in the same directory, fsync, rename, fsync of the directory.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = parent(path);
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        path.file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        std::process::id()
    ));
    let write = || -> std::io::Result<()> {
        use std::io::Write;
        let mut f = File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()
    };
    write().map_err(|e| Error::io(format!("writing {}", tmp.display()), e))?;
    std::fs::rename(&tmp, path).map_err(|e| {
        let _ = std::fs::remove_file(&tmp);
        Error::io(
            format!("renaming {} to {}", tmp.display(), path.display()),
            e,
        )
    })?;
    sync_path(dir)
}

fn parent(path: &Path) -> &Path {
    path.parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
}

/// The staging directory [`publish_dir`] moves into place: `<dir>.partial`.
pub fn staging_dir(dir: &Path) -> PathBuf {
    let mut name = dir.file_name().unwrap_or_default().to_os_string();
    name.push(".partial");
    parent(dir).join(name)
}

/// One file of a manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileEntry {
    pub bytes: u64,
    /// `rlhf_types::Checksum` of the content, as 16 hex digits.
    pub checksum: String,
    /// SHA-256 of the content (manifests written before it existed have none): what a
    /// signed checkpoint relies on, since the checksum above is not collision resistant.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sha256: Option<String>,
}

/// Every regular file of a directory (not recursing), with its size and content hash.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub files: BTreeMap<String, FileEntry>,
}

/// Size, checksum and SHA-256 of a regular file, in one pass.
fn hash_file(path: &Path) -> std::io::Result<(u64, u64, String)> {
    let mut f = open_regular(path)?;
    let mut sum = Checksum::new();
    let mut sha = ring::digest::Context::new(&ring::digest::SHA256);
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let k = f.read(&mut buf)?;
        if k == 0 {
            break;
        }
        sum.update(&buf[..k]);
        sha.update(&buf[..k]);
        n += k as u64;
    }
    Ok((n, sum.finish(), hex(sha.finish().as_ref())))
}

impl Manifest {
    /// Hashes every regular file of `dir` except the manifest itself.
    pub fn of_dir(dir: &Path) -> Result<Self> {
        let mut files = BTreeMap::new();
        let rd = std::fs::read_dir(dir)
            .map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
        for entry in rd {
            let entry = entry.map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let path = entry.path();
            let is_file = entry.file_type().is_ok_and(|t| t.is_file());
            if name == MANIFEST_FILE || !is_file {
                continue;
            }
            let (bytes, sum, sha) = hash_file(&path)
                .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
            files.insert(
                name,
                FileEntry {
                    bytes,
                    checksum: format!("{sum:016x}"),
                    sha256: Some(sha),
                },
            );
        }
        Ok(Self { files })
    }

    /// Checks that every file the manifest of `dir` lists is there, a regular file of `dir`
    /// with its size and content, and that `dir` holds no other file. The error names the
    /// first file that differs, never the size or hash it has.
    pub fn verify(dir: &Path) -> Result<Self> {
        let path = dir.join(MANIFEST_FILE);
        let text = read_regular(&path, MAX_MANIFEST_BYTES).map_err(|e| {
            Error::invalid(format!(
                "{} is not a complete checkpoint: cannot read {MANIFEST_FILE} ({e}); it was \
                 interrupted while saving, or written by an older version: resume from \
                 another checkpoint",
                dir.display()
            ))
        })?;
        let m: Manifest = serde_json::from_slice(&text)
            .map_err(|e| Error::invalid(format!("{} is damaged: {e}", path.display())))?;
        if let Some(bad) = m.files.keys().find(|n| !plain_name(n)) {
            return Err(Error::invalid(format!(
                "{} lists {bad:?}, which is not a plain file name of that directory; the \
                 manifest was not written by a save: resume from another checkpoint",
                path.display()
            )));
        }
        let rd = std::fs::read_dir(dir)
            .map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
        for entry in rd {
            let entry = entry.map_err(|e| Error::io(format!("listing {}", dir.display()), e))?;
            let name = entry.file_name().to_string_lossy().into_owned();
            let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
            if !is_dir && name != MANIFEST_FILE && !m.files.contains_key(&name) {
                return Err(Error::invalid(format!(
                    "checkpoint directory {} holds {name:?}, which its manifest does not list \
                     (added after the save): remove it or resume from another checkpoint",
                    dir.display()
                )));
            }
        }
        for (name, want) in &m.files {
            let file = dir.join(name);
            let (bytes, sum, sha) = hash_file(&file).map_err(|e| {
                Error::invalid(format!(
                    "checkpoint file {} is missing, unreadable or not a regular file ({e}); \
                     the checkpoint is damaged",
                    file.display()
                ))
            })?;
            let sha_differs = want.sha256.as_ref().is_some_and(|w| *w != sha);
            if bytes != want.bytes || format!("{sum:016x}") != want.checksum || sha_differs {
                let what = if bytes != want.bytes {
                    "size"
                } else {
                    "content"
                };
                return Err(Error::invalid(format!(
                    "checkpoint file {} changed after it was saved (its {what} differs from \
                     the manifest); resume from another checkpoint",
                    file.display()
                )));
            }
        }
        Ok(m)
    }
}

/// Publishes a directory written under [`staging_dir`]`(dir)`: fsyncs every file, writes the
/// manifest, fsyncs the staging directory, replaces `dir` by it in one rename and fsyncs the
/// parent. Until the rename, `dir` is untouched (a previous save stays whole).
pub fn publish_dir(dir: &Path) -> Result<Manifest> {
    let staging = staging_dir(dir);
    let rd = std::fs::read_dir(&staging)
        .map_err(|e| Error::io(format!("listing {}", staging.display()), e))?;
    for entry in rd {
        let path = entry
            .map_err(|e| Error::io(format!("listing {}", staging.display()), e))?
            .path();
        if path.symlink_metadata().is_ok_and(|m| m.is_file()) {
            sync_path(&path)?;
        }
    }
    let manifest = Manifest::of_dir(&staging)?;
    let text = serde_json::to_string_pretty(&manifest)
        .map_err(|e| Error::internal(format!("encoding {MANIFEST_FILE}: {e}")))?;
    write_atomic(&staging.join(MANIFEST_FILE), text.as_bytes())?;
    if dir.exists() {
        std::fs::remove_dir_all(dir)
            .map_err(|e| Error::io(format!("replacing {}", dir.display()), e))?;
    }
    std::fs::rename(&staging, dir).map_err(|e| {
        Error::io(
            format!("renaming {} to {}", staging.display(), dir.display()),
            e,
        )
    })?;
    sync_path(parent(dir))?;
    Ok(manifest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn published_dirs_verify_and_name_the_file_that_changed() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("actor");
        let staging = staging_dir(&dir);
        assert!(staging.ends_with("actor.partial"));
        std::fs::create_dir_all(&staging).unwrap();
        std::fs::write(staging.join("model.safetensors"), vec![7u8; 3000]).unwrap();
        std::fs::write(staging.join("config.json"), b"{}").unwrap();
        let m = publish_dir(&dir).unwrap();
        assert_eq!(m.files.len(), 2);
        assert!(!staging.exists() && dir.join(MANIFEST_FILE).is_file());
        assert_eq!(Manifest::verify(&dir).unwrap(), m);

        // Same size, one byte different: refused by name.
        let mut bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
        bytes[1500] = 0;
        std::fs::write(dir.join("model.safetensors"), &bytes).unwrap();
        let e = Manifest::verify(&dir).unwrap_err().to_string();
        assert!(
            e.contains("model.safetensors") && e.contains("changed"),
            "{e}"
        );
        // Gone: refused by name.
        std::fs::remove_file(dir.join("config.json")).unwrap();
        std::fs::write(dir.join("model.safetensors"), vec![7u8; 3000]).unwrap();
        let e = Manifest::verify(&dir).unwrap_err().to_string();
        assert!(e.contains("config.json") && e.contains("missing"), "{e}");
        // No manifest: not a complete checkpoint.
        std::fs::remove_file(dir.join(MANIFEST_FILE)).unwrap();
        let e = Manifest::verify(&dir).unwrap_err().to_string();
        assert!(e.contains("not a complete checkpoint"), "{e}");
    }

    #[test]
    fn a_new_publish_replaces_the_old_dir_whole_and_atomic_writes_leave_no_temp() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("critic");
        for round in 0..2u8 {
            let staging = staging_dir(&dir);
            std::fs::create_dir_all(&staging).unwrap();
            std::fs::write(staging.join(format!("f{round}")), [round]).unwrap();
            publish_dir(&dir).unwrap();
        }
        let names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        assert!(
            names.contains(&"f1".to_string()) && !names.contains(&"f0".to_string()),
            "{names:?}"
        );
        write_atomic(&root.path().join("state.json"), b"1").unwrap();
        write_atomic(&root.path().join("state.json"), b"2").unwrap();
        assert_eq!(std::fs::read(root.path().join("state.json")).unwrap(), b"2");
        let left: Vec<_> = std::fs::read_dir(root.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .filter(|n| n.to_string_lossy().contains(".tmp-"))
            .collect();
        assert!(left.is_empty(), "{left:?}");
    }

    /// What an attacker who can write a checkpoint directory tried: manifest names outside
    /// the directory, a device, a FIFO and a link in it, a file the manifest does not list.
    /// Each is refused at once, by name, without reading what it points at.
    #[test]
    fn manifests_name_only_regular_files_of_their_directory() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("actor");
        std::fs::create_dir_all(staging_dir(&dir)).unwrap();
        std::fs::write(staging_dir(&dir).join("model.safetensors"), [3u8; 100]).unwrap();
        let good = publish_dir(&dir).unwrap();
        assert!(good.files["model.safetensors"].sha256.is_some());
        let with = |name: &str| {
            let mut m = good.clone();
            m.files.insert(
                name.to_string(),
                FileEntry {
                    bytes: 0,
                    checksum: "0".repeat(16),
                    sha256: None,
                },
            );
            std::fs::write(dir.join(MANIFEST_FILE), serde_json::to_string(&m).unwrap()).unwrap();
        };
        for bad in [
            "../../../../../../proc/self/environ",
            "/dev/zero",
            "..",
            "a/b",
            "",
        ] {
            with(bad);
            let t = std::time::Instant::now();
            let e = Manifest::verify(&dir).unwrap_err().to_string();
            assert!(e.contains("not a plain file name"), "{bad}: {e}");
            assert!(t.elapsed() < std::time::Duration::from_secs(1));
        }
        // A FIFO listed by a plain name: refused without blocking on it.
        let fifo = dir.join("pipe");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: `c` is a NUL-terminated path that outlives the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        with("pipe");
        let t = std::time::Instant::now();
        let e = Manifest::verify(&dir).unwrap_err().to_string();
        assert!(t.elapsed() < std::time::Duration::from_secs(1));
        // The cause in parentheses is the check's own, not the fixed wording around it.
        assert!(
            e.contains("pipe") && e.contains("(not a regular file)"),
            "{e}"
        );
        std::fs::remove_file(&fifo).unwrap();
        // A link to a file elsewhere, listed: refused (a link is not followed).
        std::os::unix::fs::symlink("/etc/hostname", dir.join("link")).unwrap();
        with("link");
        let e = Manifest::verify(&dir).unwrap_err().to_string();
        // O_NOFOLLOW: opening the link itself fails (ELOOP).
        assert!(e.contains("link") && e.contains("os error 40"), "{e}");
        // The same link, unlisted: the directory holds a file its manifest does not list.
        std::fs::write(
            dir.join(MANIFEST_FILE),
            serde_json::to_string(&good).unwrap(),
        )
        .unwrap();
        let e = Manifest::verify(&dir).unwrap_err().to_string();
        assert!(e.contains("\"link\"") && e.contains("does not list"), "{e}");
        std::fs::remove_file(dir.join("link")).unwrap();
        Manifest::verify(&dir).unwrap();
        // Content changed: the error names the file, not the hash the new content has.
        std::fs::write(dir.join("model.safetensors"), [4u8; 100]).unwrap();
        let e = Manifest::verify(&dir).unwrap_err().to_string();
        let (_, sum, sha) = hash_file(&dir.join("model.safetensors")).unwrap();
        assert!(e.contains("content differs"), "{e}");
        assert!(
            !e.contains(&format!("{sum:016x}")) && !e.contains(&sha),
            "{e}"
        );
    }
}
