//! Downloads a repo's model files into the cache, in `huggingface_hub`'s layout (blobs named
//! by their etag, relative symlinks from the snapshot, `refs/{revision}`), so that the
//! Python tools and this crate share one cache.
//!
//! Two HTTPS calls per repo kind: `GET {endpoint}/api/models/{id}/revision/{rev}?blobs=true`
//! (the commit hash, the file list, each file's blob id and size), then one
//! `GET {endpoint}/{id}/resolve/{commit}/{file}` per file. Every file is written to a temporary
//! name and renamed into place, so a crash never leaves a truncated blob under its final
//! name; processes of this crate on one machine take a per-repo lock, so the roles of a
//! node download a model once between them.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

use crate::cache::{index_shards, safe_repo_path, Need, WEIGHTS, WEIGHTS_INDEX};
use crate::repo_id::{is_commit_hash, RepoId};
use crate::Hub;

/// Tokenizer and generation files fetched when the repo has them (the tokenizer crate reads
/// `tokenizer.json`, `tokenizer_config.json` and a chat template file; sampling reads
/// `generation_config.json`).
pub const TOKENIZER_DOWNLOADS: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
];

/// Largest repo listing read (a listing is a few kB; this bounds a misbehaving server).
const MAX_LISTING_BYTES: u64 = 32 << 20;

#[derive(Debug, Deserialize)]
struct RepoInfo {
    #[serde(default)]
    sha: Option<String>,
    #[serde(default)]
    siblings: Vec<Sibling>,
}

#[derive(Debug, Clone, Deserialize)]
struct Sibling {
    rfilename: String,
    #[serde(default, rename = "blobId")]
    blob_id: Option<String>,
    #[serde(default)]
    size: Option<u64>,
    #[serde(default)]
    lfs: Option<Lfs>,
}

#[derive(Debug, Clone, Deserialize)]
struct Lfs {
    #[serde(default)]
    sha256: Option<String>,
    #[serde(default)]
    size: Option<u64>,
}

impl Sibling {
    /// The blob name `huggingface_hub` gives the file: the LFS sha256 for LFS files, the git
    /// blob id otherwise (what the Hub sends as the file's etag).
    fn blob_name(&self) -> Option<&str> {
        let hex =
            |s: &&str| s.len() >= 40 && s.len() <= 64 && s.bytes().all(|b| b.is_ascii_hexdigit());
        self.lfs
            .as_ref()
            .and_then(|l| l.sha256.as_deref())
            .filter(hex)
            .or_else(|| self.blob_id.as_deref().filter(hex))
    }

    fn expected_size(&self) -> Option<u64> {
        self.lfs.as_ref().and_then(|l| l.size).or(self.size)
    }
}

/// Percent-encodes one URL path segment (letters, digits and `-._~` stay).
fn encode_segment(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Encodes a `/`-separated repo path segment by segment (the slashes stay).
fn encode_path(s: &str) -> String {
    s.split('/')
        .map(encode_segment)
        .collect::<Vec<_>>()
        .join("/")
}

fn mib(bytes: u64) -> String {
    format!("{:.1} MiB", bytes as f64 / (1024.0 * 1024.0))
}

/// Whether the proxy variables (`HTTPS_PROXY`, ...) apply to `endpoint`: not for a loopback
/// host, nor for one `NO_PROXY` lists (exact host, domain suffix, or `*`).
fn use_proxy(endpoint: &str) -> bool {
    let rest = endpoint.split_once("://").map_or(endpoint, |(_, r)| r);
    let authority = rest.split('/').next().unwrap_or_default();
    let host = match authority.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or_default(),
        None => authority.split(':').next().unwrap_or_default(),
    }
    .to_ascii_lowercase();
    if matches!(host.as_str(), "localhost" | "127.0.0.1" | "::1") {
        return false;
    }
    let no_proxy = std::env::var("NO_PROXY")
        .or_else(|_| std::env::var("no_proxy"))
        .unwrap_or_default();
    !no_proxy.split(',').map(str::trim).any(|p| {
        let p = p.trim_start_matches('.').to_ascii_lowercase();
        !p.is_empty() && (p == "*" || host == p || host.ends_with(&format!(".{p}")))
    })
}

struct Client<'a> {
    hub: &'a Hub,
    agent: ureq::Agent,
    token: Option<String>,
}

impl<'a> Client<'a> {
    fn new(hub: &'a Hub) -> Self {
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(Duration::from_secs(30))
            .timeout_read(Duration::from_secs(120))
            .timeout_write(Duration::from_secs(60))
            .redirects(10)
            .redirect_auth_headers(ureq::RedirectAuthHeaders::SameHost)
            .try_proxy_from_env(use_proxy(&hub.endpoint))
            .user_agent(concat!("rlhf-hub/", env!("CARGO_PKG_VERSION")))
            .build();
        let token = hub
            .token
            .clone()
            .or_else(|| hub.token_from_env.then(crate::read_token).flatten());
        Self { hub, agent, token }
    }

    fn get(&self, url: &str) -> Result<ureq::Response, String> {
        let mut req = self.agent.get(url);
        if let Some(token) = &self.token {
            req = req.set("Authorization", &format!("Bearer {token}"));
        }
        req.call().map_err(|e| match e {
            ureq::Error::Status(code @ (401 | 403), _) => format!(
                "{url} answered HTTP {code}: the repo does not exist, or it is private or gated \
                 (accept its terms on the Hub and set HF_TOKEN, or log in with `huggingface-cli login`)"
            ),
            ureq::Error::Status(404, _) => {
                format!("{url} answered HTTP 404: no such repo, revision or file")
            }
            ureq::Error::Status(code, r) => {
                format!("{url} answered HTTP {code} {}", r.status_text())
            }
            ureq::Error::Transport(t) => format!("cannot fetch {url}: {t}"),
        })
    }

    fn info(&self, repo: &RepoId) -> Result<RepoInfo, String> {
        let url = format!(
            "{}/api/models/{}/revision/{}?blobs=true",
            self.hub.endpoint,
            encode_path(&repo.id()),
            encode_segment(repo.revision())
        );
        let mut body = Vec::new();
        self.get(&url)?
            .into_reader()
            .take(MAX_LISTING_BYTES)
            .read_to_end(&mut body)
            .map_err(|e| format!("reading {url}: {e}"))?;
        serde_json::from_slice(&body)
            .map_err(|e| format!("{url} did not return a repo listing: {e}"))
    }

    /// Streams `file` of `repo` at `commit` into `dest` (created), checking the size when it
    /// is known. Returns the bytes written.
    fn fetch(
        &self,
        repo: &RepoId,
        commit: &str,
        file: &str,
        dest: &Path,
        expected: Option<u64>,
    ) -> Result<u64, String> {
        let url = format!(
            "{}/{}/resolve/{commit}/{}",
            self.hub.endpoint,
            encode_path(&repo.id()),
            encode_path(file)
        );
        let resp = self.get(&url)?;
        let announced: Option<u64> = resp
            .header("Content-Length")
            .and_then(|v| v.trim().parse().ok());
        let mut out =
            File::create(dest).map_err(|e| format!("cannot create {}: {e}", dest.display()))?;
        let written = std::io::copy(&mut resp.into_reader(), &mut out)
            .map_err(|e| format!("downloading {url}: {e}"))?;
        out.flush()
            .and_then(|_| out.sync_all())
            .map_err(|e| format!("writing {}: {e}", dest.display()))?;
        for want in [expected, announced].into_iter().flatten() {
            if written != want {
                return Err(format!(
                    "{url}: got {written} bytes, expected {want} (the download was cut short)"
                ));
            }
        }
        Ok(written)
    }
}

/// Writes `text` to `path` through a temporary file and a rename.
fn write_atomic(path: &Path, text: &str) -> std::io::Result<()> {
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let tmp = path.with_extension(format!("{}.tmp", std::process::id()));
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, path)
}

/// Points `link` (inside `snapshots/{commit}/`) at `blob`, relative as `huggingface_hub`
/// does; on systems without symlinks the blob is copied.
fn link_blob(blob: &Path, link: &Path, file: &str, blob_name: &str) -> std::io::Result<()> {
    if std::fs::symlink_metadata(link).is_ok() {
        // A dangling link or a stale file from an interrupted run.
        std::fs::remove_file(link)?;
    }
    #[cfg(unix)]
    {
        let _ = blob;
        let up = "../".repeat(file.split('/').count() + 1);
        std::os::unix::fs::symlink(format!("{up}blobs/{blob_name}"), link)
    }
    #[cfg(not(unix))]
    {
        let _ = (file, blob_name);
        std::fs::copy(blob, link).map(|_| ())
    }
}

/// Fetches what `need` asks of `repo` into the cache and returns the snapshot directory.
/// The caller holds the repo lock and has seen the cache lacks it.
pub(crate) fn download(hub: &Hub, repo: &RepoId, need: Need) -> Result<PathBuf, String> {
    let client = Client::new(hub);
    let info = client.info(repo)?;
    let commit = info
        .sha
        .clone()
        .filter(|s| is_commit_hash(s))
        .ok_or_else(|| format!("the Hub's listing of {repo} has no commit hash"))?;
    let by_name: HashMap<&str, &Sibling> = info
        .siblings
        .iter()
        .filter(|s| safe_repo_path(&s.rfilename))
        .map(|s| (s.rfilename.as_str(), s))
        .collect();
    let has = |f: &str| by_name.contains_key(f);

    let mut files: Vec<String> = Vec::new();
    match need {
        Need::Config | Need::Model if !has("config.json") => {
            return Err(format!(
                "{repo} at {commit} has no config.json (not a transformers model repo)"
            ));
        }
        Need::Tokenizer if !has("tokenizer.json") => {
            return Err(format!(
                "{repo} at {commit} has no tokenizer.json (only fast tokenizers are supported)"
            ));
        }
        _ => {}
    }
    if has("config.json") {
        files.push("config.json".into());
    }
    if need != Need::Config {
        files.extend(
            TOKENIZER_DOWNLOADS
                .iter()
                .filter(|f| has(f))
                .map(|f| f.to_string()),
        );
    }
    let sharded = need == Need::Model && !has(WEIGHTS);
    if need == Need::Model {
        if has(WEIGHTS) {
            files.push(WEIGHTS.into());
        } else if has(WEIGHTS_INDEX) {
            files.push(WEIGHTS_INDEX.into());
        } else {
            let other: Vec<&str> = by_name
                .keys()
                .copied()
                .filter(|f| f.ends_with(".bin") || f.ends_with(".pt") || f.ends_with(".gguf"))
                .collect();
            return Err(format!(
                "{repo} at {commit} has no {WEIGHTS} or {WEIGHTS_INDEX}; only safetensors \
                 weights are read{}",
                if other.is_empty() {
                    String::new()
                } else {
                    format!(" (it has {})", other.join(", "))
                }
            ));
        }
    }

    let repo_dir = hub.cache.join(repo.folder_name());
    let snapshot = repo_dir.join("snapshots").join(&commit);
    let blobs = repo_dir.join("blobs");
    for dir in [&snapshot, &blobs] {
        std::fs::create_dir_all(dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    }
    let total: u64 = files
        .iter()
        .filter_map(|f| by_name.get(f.as_str()).and_then(|s| s.expected_size()))
        .sum();
    hub.say(&format!(
        "downloading {repo} (commit {commit}) from {} into {}: {} file(s){}",
        hub.endpoint,
        hub.cache.display(),
        files.len(),
        if total > 0 && !sharded {
            format!(", {}", mib(total))
        } else {
            String::new()
        }
    ));
    let mut i = 0;
    while i < files.len() {
        let file = files[i].clone();
        i += 1;
        let sib = by_name.get(file.as_str()).copied();
        fetch_file(hub, &client, repo, &commit, &snapshot, &blobs, &file, sib)?;
        if file == WEIGHTS_INDEX {
            let shards = index_shards(&snapshot.join(WEIGHTS_INDEX))
                .map_err(|e| format!("{repo}'s {WEIGHTS_INDEX}: {e}"))?;
            for shard in shards {
                if !has(&shard) {
                    return Err(format!(
                        "{repo}'s {WEIGHTS_INDEX} lists {shard}, which the repo does not have"
                    ));
                }
                files.push(shard);
            }
        }
    }
    if !is_commit_hash(repo.revision()) {
        let refs = repo_dir.join("refs").join(repo.revision());
        write_atomic(&refs, &commit)
            .map_err(|e| format!("cannot write {}: {e}", refs.display()))?;
    }
    Ok(snapshot)
}

#[allow(clippy::too_many_arguments)]
fn fetch_file(
    hub: &Hub,
    client: &Client<'_>,
    repo: &RepoId,
    commit: &str,
    snapshot: &Path,
    blobs: &Path,
    file: &str,
    sib: Option<&Sibling>,
) -> Result<(), String> {
    let link = snapshot.join(file);
    if link.is_file() {
        return Ok(());
    }
    if let Some(parent) = link.parent() {
        std::fs::create_dir_all(parent)
            .map_err(|e| format!("cannot create {}: {e}", parent.display()))?;
    }
    let expected = sib.and_then(Sibling::expected_size);
    if let Some(size) = expected.filter(|s| *s >= 16 << 20) {
        hub.say(&format!("  {file} ({})", mib(size)));
    }
    let pid = std::process::id();
    match sib.and_then(Sibling::blob_name) {
        Some(blob_name) => {
            let blob = blobs.join(blob_name);
            let complete = std::fs::metadata(&blob)
                .is_ok_and(|m| m.is_file() && expected.is_none_or(|s| m.len() == s));
            if !complete {
                let tmp = blobs.join(format!("{blob_name}.{pid}.incomplete"));
                let got = client.fetch(repo, commit, file, &tmp, expected);
                if let Err(e) = got {
                    let _ = std::fs::remove_file(&tmp);
                    return Err(e);
                }
                std::fs::rename(&tmp, &blob)
                    .map_err(|e| format!("cannot move {} into place: {e}", tmp.display()))?;
            }
            link_blob(&blob, &link, file, blob_name)
                .map_err(|e| format!("cannot link {} to its blob: {e}", link.display()))
        }
        None => {
            // No blob id in the listing: keep the file itself in the snapshot.
            let name = link
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let tmp = link.with_file_name(format!("{name}.{pid}.incomplete"));
            let got = client.fetch(repo, commit, file, &tmp, expected);
            if let Err(e) = got {
                let _ = std::fs::remove_file(&tmp);
                return Err(e);
            }
            std::fs::rename(&tmp, &link)
                .map_err(|e| format!("cannot move {} into place: {e}", tmp.display()))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_endpoints_skip_the_proxy() {
        assert!(!use_proxy("http://127.0.0.1:8080"));
        assert!(!use_proxy("http://localhost/x"));
        assert!(!use_proxy("http://[::1]:80"));
    }

    #[test]
    fn urls_are_encoded_per_segment() {
        assert_eq!(encode_path("Qwen/Qwen2.5-0.5B"), "Qwen/Qwen2.5-0.5B");
        assert_eq!(encode_segment("refs/pr/1"), "refs%2Fpr%2F1");
        assert_eq!(encode_path("a b/c+d.json"), "a%20b/c%2Bd.json");
    }

    #[test]
    fn blob_names_prefer_the_lfs_hash_and_refuse_odd_ones() {
        let s: Sibling = serde_json::from_str(
            r#"{"rfilename": "model.safetensors", "blobId": "0123456789abcdef0123456789abcdef01234567",
                "lfs": {"sha256": "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", "size": 10}}"#,
        )
        .unwrap();
        assert_eq!(s.blob_name(), Some("a".repeat(64).as_str()));
        assert_eq!(s.expected_size(), Some(10));
        let s: Sibling =
            serde_json::from_str(r#"{"rfilename": "x", "blobId": "../../etc/passwd"}"#).unwrap();
        assert_eq!(s.blob_name(), None);
    }
}
