//! Model specs as users write them (`Qwen/Qwen2.5-0.5B-Instruct`, `owner/name@revision`)
//! turned into model directories through the local Hugging Face cache, downloading what is
//! missing when the process is online.
//!
//! A crate of its own, without candle, because three kinds of process need it: the role
//! processes and `rlhf generate` (which load the model: each node resolves through its own
//! cache), the PPO driver in the head (which only needs the tokenizer files) and the config
//! checks (`rlhf-head check`, path handling at load), which must not link a tensor library.
//! `rlhf_model::hub` re-exports it for the model side.
//!
//! ```
//! # let tmp = tempfile::tempdir().unwrap();
//! use rlhf_hub::{Hub, Located, Need};
//! let hub = Hub::new(tmp.path()); // offline, this cache; `Hub::from_env()` reads the environment
//! match hub.locate("Qwen/Qwen2.5-0.5B-Instruct", Need::Model).unwrap() {
//!     Located::Directory(dir) | Located::Cached { dir, .. } => println!("load {}", dir.display()),
//!     Located::NotCached { why, .. } => println!("not cached: {why}"),
//! }
//! assert!(hub.resolve_model("../x").is_err()); // neither a directory nor a repo id
//! ```

mod cache;
mod download;
mod repo_id;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use cache::{cache_dir_from_env, lacks, offline_from_env, Need, WEIGHTS, WEIGHTS_INDEX};
pub use download::TOKENIZER_DOWNLOADS;
pub use repo_id::{is_commit_hash, IdError, RepoId};

/// The Hub the downloads come from unless `HF_ENDPOINT` names another.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";

/// Why a spec could not be turned into a directory.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Not an existing directory, and not a valid repo id either.
    #[error(
        "model '{spec}' is neither an existing directory nor a Hugging Face repo id: {reason}"
    )]
    InvalidSpec { spec: String, reason: IdError },

    /// A valid repo id the cache does not hold, and that could not be downloaded (offline, or
    /// the download failed).
    #[error("{}", not_cached_message(.repo, .cache, .why, .download_error.as_deref()))]
    NotCached {
        /// The id with its revision, as written (boxed: errors stay small).
        repo: Box<RepoId>,
        /// The cache directory looked in.
        cache: PathBuf,
        /// What the cache lacks.
        why: String,
        /// `None`: offline (`HF_HUB_OFFLINE`); `Some`: why the download failed.
        download_error: Option<String>,
    },

    /// The cache directory could not be used (creating the lock file, say).
    #[error("cannot use the Hugging Face cache at {}: {source}", .path.display())]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn fetch_hint(repo: &RepoId) -> String {
    let rev = if repo.has_revision() {
        format!(" --revision {}", repo.revision())
    } else {
        String::new()
    };
    format!(
        "fetch it with `huggingface-cli download {}{rev}`, point HF_HUB_CACHE or HF_HOME at a \
         cache that holds it, or give a local model directory",
        repo.id()
    )
}

fn not_cached_message(repo: &RepoId, cache: &Path, why: &str, failed: Option<&str>) -> String {
    let head = format!(
        "model '{repo}' is not a local directory, and the Hugging Face cache at {} does not \
         hold it ({why})",
        cache.display()
    );
    match failed {
        None => format!(
            "{head}; HF_HUB_OFFLINE is set, so it is not downloaded: {}",
            fetch_hint(repo)
        ),
        Some(e) => format!("{head}; downloading it failed: {e}; {}", fetch_hint(repo)),
    }
}

/// Where a spec points, found without touching the network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Located {
    /// The spec is an existing directory (used as it is).
    Directory(PathBuf),
    /// A repo id whose cached snapshot has what was asked for.
    Cached { repo: RepoId, dir: PathBuf },
    /// A repo id the cache does not hold (or not completely).
    NotCached {
        repo: RepoId,
        cache: PathBuf,
        why: String,
    },
}

/// The cache to resolve through, whether downloads are allowed, and from where.
#[derive(Clone)]
pub struct Hub {
    cache: PathBuf,
    online: bool,
    endpoint: String,
    token: Option<String>,
    /// Read the token from the environment when a download needs it (not before: a lookup
    /// never touches the token file).
    token_from_env: bool,
    log: Arc<dyn Fn(&str) + Send + Sync>,
}

impl fmt::Debug for Hub {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Hub")
            .field("cache", &self.cache)
            .field("online", &self.online)
            .field("endpoint", &self.endpoint)
            .field("token", &self.token.as_ref().map(|_| "(set)"))
            .finish()
    }
}

pub(crate) fn read_token() -> Option<String> {
    let clean = |s: String| Some(s.trim().to_string()).filter(|t| !t.is_empty());
    for key in ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"] {
        if let Some(t) = std::env::var(key).ok().and_then(clean) {
            return Some(t);
        }
    }
    let path = std::env::var_os("HF_TOKEN_PATH")
        .filter(|p| !p.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(|| cache::hf_home_from_env().join("token"));
    std::fs::read_to_string(path).ok().and_then(clean)
}

impl Hub {
    /// An offline hub over `cache` (the `hub` directory itself, holding `models--*` folders),
    /// with the default endpoint and no token: what tests and explicit callers start from.
    pub fn new(cache: impl Into<PathBuf>) -> Self {
        Self {
            cache: cache.into(),
            online: false,
            endpoint: DEFAULT_ENDPOINT.to_string(),
            token: None,
            token_from_env: false,
            log: Arc::new(|msg| tracing::info!("{msg}")),
        }
    }

    /// The hub the environment describes: the cache from `HF_HUB_CACHE` / `HF_HOME` (see
    /// [`cache_dir_from_env`]), online unless `HF_HUB_OFFLINE=1`, the endpoint from
    /// `HF_ENDPOINT`, the token from `HF_TOKEN` or the token file `huggingface-cli login`
    /// writes.
    pub fn from_env() -> Self {
        let endpoint = std::env::var("HF_ENDPOINT")
            .ok()
            .map(|e| e.trim().trim_end_matches('/').to_string())
            .filter(|e| !e.is_empty())
            .unwrap_or_else(|| DEFAULT_ENDPOINT.to_string());
        Self {
            online: !offline_from_env(),
            endpoint,
            token_from_env: true,
            ..Self::new(cache_dir_from_env())
        }
    }

    /// Allows (or forbids) downloads.
    pub fn online(mut self, online: bool) -> Self {
        self.online = online;
        self
    }

    /// Downloads from `endpoint` (`https://huggingface.co`, a mirror, a test server).
    pub fn with_endpoint(mut self, endpoint: impl Into<String>) -> Self {
        self.endpoint = endpoint.into().trim_end_matches('/').to_string();
        self
    }

    /// The access token sent with downloads (gated and private repos).
    pub fn with_token(mut self, token: Option<String>) -> Self {
        self.token = token;
        self.token_from_env = false;
        self
    }

    /// Where progress messages go (default: `tracing::info!`).
    pub fn with_log(mut self, log: impl Fn(&str) + Send + Sync + 'static) -> Self {
        self.log = Arc::new(log);
        self
    }

    /// The cache directory.
    pub fn cache_dir(&self) -> &Path {
        &self.cache
    }

    /// Whether a missing model is downloaded.
    pub fn is_online(&self) -> bool {
        self.online
    }

    /// The endpoint downloads come from.
    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    fn say(&self, msg: &str) {
        (self.log)(msg)
    }

    /// Where `spec` points, without downloading: an existing directory is itself; otherwise a
    /// repo id is looked up in the cache. Errors only when `spec` is neither.
    pub fn locate(&self, spec: &str, need: Need) -> Result<Located, Error> {
        if Path::new(spec).is_dir() {
            return Ok(Located::Directory(PathBuf::from(spec)));
        }
        let repo = RepoId::parse(spec).map_err(|reason| Error::InvalidSpec {
            spec: spec.to_string(),
            reason,
        })?;
        Ok(match cache::lookup(&self.cache, &repo, need) {
            Ok(dir) => Located::Cached { repo, dir },
            Err(why) => Located::NotCached {
                repo,
                cache: self.cache.clone(),
                why,
            },
        })
    }

    /// The directory `spec` names, holding what `need` asks: an existing directory as it is
    /// (whatever it holds: the loader names a missing file), else the cached snapshot of the
    /// repo id, downloaded first when the cache lacks it and the hub is online.
    pub fn resolve(&self, spec: &str, need: Need) -> Result<PathBuf, Error> {
        let (repo, why) = match self.locate(spec, need)? {
            Located::Directory(dir) | Located::Cached { dir, .. } => return Ok(dir),
            Located::NotCached { repo, why, .. } => (repo, why),
        };
        let not_cached = |why: String, download_error: Option<String>| Error::NotCached {
            repo: Box::new(repo.clone()),
            cache: self.cache.clone(),
            why,
            download_error,
        };
        if !self.online {
            return Err(not_cached(why, None));
        }
        // One download per repo among the processes of this machine: the others wait here
        // and then find the snapshot complete.
        let locks = self.cache.join(".locks").join(repo.folder_name());
        let io = |source| Error::Io {
            path: self.cache.clone(),
            source,
        };
        std::fs::create_dir_all(&locks).map_err(io)?;
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(locks.join("rlhf-download.lock"))
            .map_err(io)?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                self.say(&format!(
                    "waiting for another process that is downloading {repo} into {}",
                    self.cache.display()
                ));
                // Bounded: a process stopped while holding the lock must not hang this one.
                let since = std::time::Instant::now();
                loop {
                    std::thread::sleep(std::time::Duration::from_millis(500));
                    match lock.try_lock() {
                        Ok(()) | Err(std::fs::TryLockError::Error(_)) => break,
                        Err(std::fs::TryLockError::WouldBlock) if since.elapsed() > LOCK_WAIT => {
                            return Err(not_cached(
                                why,
                                Some(format!(
                                    "another process has been downloading it for {} min (lock {}); if none is, remove that file",
                                    LOCK_WAIT.as_secs() / 60,
                                    locks.join("rlhf-download.lock").display()
                                )),
                            ));
                        }
                        Err(std::fs::TryLockError::WouldBlock) => {}
                    }
                }
            }
            // A filesystem without locks: download unlocked (files still land atomically).
            Err(std::fs::TryLockError::Error(_)) => {}
        }
        if let Ok(dir) = cache::lookup(&self.cache, &repo, need) {
            return Ok(dir);
        }
        let dir =
            download::download(self, &repo, need).map_err(|e| not_cached(why.clone(), Some(e)))?;
        match cache::lacks(&dir, need) {
            None => Ok(dir),
            Some(what) => Err(not_cached(
                why,
                Some(format!(
                    "after the download, {} still lacks {what}",
                    dir.display()
                )),
            )),
        }
    }

    /// [`Hub::resolve`] for a model to load.
    pub fn resolve_model(&self, spec: &str) -> Result<PathBuf, Error> {
        self.resolve(spec, Need::Model)
    }

    /// [`Hub::resolve`] for a tokenizer (downloads only the tokenizer and config files).
    pub fn resolve_tokenizer(&self, spec: &str) -> Result<PathBuf, Error> {
        self.resolve(spec, Need::Tokenizer)
    }
}

/// Whether `spec` is a syntactically valid Hub repo id (`name` or `owner/name`, optional
/// `@revision`); says nothing about whether it exists.
pub fn is_repo_id(spec: &str) -> bool {
    RepoId::parse(spec).is_ok()
}

/// The model directory for `spec` through the environment's cache ([`Hub::from_env`]).
pub fn resolve_model(spec: &str) -> Result<PathBuf, Error> {
    Hub::from_env().resolve_model(spec)
}

/// The tokenizer directory for `spec` through the environment's cache.
pub fn resolve_tokenizer(spec: &str) -> Result<PathBuf, Error> {
    Hub::from_env().resolve_tokenizer(spec)
}

/// Longest a process waits for another one on the same machine to finish downloading a repo.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(3600);

/// Builds caches in the exact `huggingface_hub` layout for tests (of this crate and of the
/// crates that load through it), without a network.
#[doc(hidden)]
pub mod test_support {
    use std::path::{Path, PathBuf};

    /// A 64-hex-digit name derived from the bytes (FNV-1a, repeated): stands in for the
    /// sha256 etag the Hub would give the blob.
    fn blob_name(bytes: &[u8]) -> String {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in bytes {
            h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
        format!("{h:016x}").repeat(4)
    }

    /// Adds `files` (name in the repo, source file) to `repo` (`owner/name`) in `cache` as
    /// snapshot `commit`: each file copied to `blobs/` and linked from `snapshots/{commit}/`
    /// (a relative symlink on Unix), and `refs/{revision}` set to `commit` when a revision is
    /// given. Returns the snapshot directory.
    pub fn add_snapshot(
        cache: &Path,
        repo: &str,
        revision: Option<&str>,
        commit: &str,
        files: &[(&str, &Path)],
    ) -> std::io::Result<PathBuf> {
        let id = crate::RepoId::parse(repo)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string()))?;
        let repo_dir = cache.join(id.folder_name());
        let snapshot = repo_dir.join("snapshots").join(commit);
        std::fs::create_dir_all(repo_dir.join("blobs"))?;
        std::fs::create_dir_all(&snapshot)?;
        for (name, src) in files {
            let bytes = std::fs::read(src)?;
            let blob = blob_name(&bytes);
            std::fs::write(repo_dir.join("blobs").join(&blob), &bytes)?;
            let link = snapshot.join(name);
            if let Some(p) = link.parent() {
                std::fs::create_dir_all(p)?;
            }
            let _ = std::fs::remove_file(&link);
            #[cfg(unix)]
            {
                let up = "../".repeat(name.split('/').count() + 1);
                std::os::unix::fs::symlink(format!("{up}blobs/{blob}"), &link)?;
            }
            #[cfg(not(unix))]
            std::fs::write(&link, &bytes)?;
        }
        if let Some(rev) = revision {
            let r = repo_dir.join("refs").join(rev);
            if let Some(p) = r.parent() {
                std::fs::create_dir_all(p)?;
            }
            std::fs::write(r, commit)?;
        }
        Ok(snapshot)
    }

    /// [`add_snapshot`] of every file in directory `dir` (a model directory made by a test or
    /// committed as a fixture).
    pub fn add_snapshot_of_dir(
        cache: &Path,
        repo: &str,
        revision: Option<&str>,
        commit: &str,
        dir: &Path,
    ) -> std::io::Result<PathBuf> {
        let mut files = Vec::new();
        for e in std::fs::read_dir(dir)? {
            let e = e?;
            files.push((e.file_name().to_string_lossy().into_owned(), e.path()));
        }
        let refs: Vec<(&str, &Path)> = files
            .iter()
            .map(|(n, p)| (n.as_str(), p.as_path()))
            .collect();
        add_snapshot(cache, repo, revision, commit, &refs)
    }
}
