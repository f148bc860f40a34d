//! Resolution through a fake cache in the exact `huggingface_hub` layout, and downloads from a
//! fake Hub served on 127.0.0.1 (no network, no process environment changed).

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use rlhf_hub::test_support::add_snapshot;
use rlhf_hub::{Error, Hub, Located, Need};

const MAIN: &str = "1111111111111111111111111111111111111111";
const V1: &str = "2222222222222222222222222222222222222222";

/// A directory of small stand-in files (the loader is tested in rlhf-model; here only
/// presence counts).
fn files(dir: &Path, names: &[&str]) -> Vec<(String, PathBuf)> {
    names
        .iter()
        .map(|n| {
            let p = dir.join(n.replace('/', "_"));
            std::fs::write(&p, format!("contents of {n}")).unwrap();
            (n.to_string(), p)
        })
        .collect()
}

fn add(cache: &Path, repo: &str, rev: Option<&str>, commit: &str, names: &[&str]) -> PathBuf {
    let src = tempfile::tempdir().unwrap();
    let f = files(src.path(), names);
    let refs: Vec<(&str, &Path)> = f.iter().map(|(n, p)| (n.as_str(), p.as_path())).collect();
    add_snapshot(cache, repo, rev, commit, &refs).unwrap()
}

const MODEL: &[&str] = &["config.json", "model.safetensors", "tokenizer.json"];

#[test]
fn owner_name_resolves_to_the_snapshot_of_refs_main() {
    let tmp = tempfile::tempdir().unwrap();
    let snap = add(tmp.path(), "acme/tiny", Some("main"), MAIN, MODEL);
    let hub = Hub::new(tmp.path());
    let dir = hub.resolve_model("acme/tiny").unwrap();
    assert_eq!(dir, snap);
    assert_eq!(
        dir,
        tmp.path()
            .join("models--acme--tiny")
            .join("snapshots")
            .join(MAIN)
    );
    // The snapshot's files are symlinks into blobs/.
    let link = std::fs::read_link(dir.join("config.json")).unwrap();
    assert!(link.starts_with("../../blobs"), "{}", link.display());
    assert!(std::fs::read_to_string(dir.join("config.json"))
        .unwrap()
        .contains("config.json"));
    // A name without an owner.
    let snap = add(tmp.path(), "gpt2", Some("main"), MAIN, MODEL);
    assert_eq!(hub.resolve_model("gpt2").unwrap(), snap);
    assert!(snap.starts_with(tmp.path().join("models--gpt2")));
    match hub.locate("acme/tiny", Need::Model).unwrap() {
        Located::Cached { repo, dir } => {
            assert_eq!(repo.id(), "acme/tiny");
            assert_eq!(dir, hub.resolve_model("acme/tiny").unwrap());
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn revisions_and_commit_hashes() {
    let tmp = tempfile::tempdir().unwrap();
    let main = add(tmp.path(), "acme/tiny", Some("main"), MAIN, MODEL);
    let v1 = add(tmp.path(), "acme/tiny", Some("v1"), V1, MODEL);
    let pr = add(tmp.path(), "acme/tiny", Some("refs/pr/3"), V1, MODEL);
    let hub = Hub::new(tmp.path());
    assert_eq!(hub.resolve_model("acme/tiny@main").unwrap(), main);
    assert_eq!(hub.resolve_model("acme/tiny@v1").unwrap(), v1);
    assert_eq!(hub.resolve_model("acme/tiny@refs/pr/3").unwrap(), pr);
    // A commit hash names its snapshot directly (no ref needed).
    let bare = "3333333333333333333333333333333333333333";
    let snap = add(tmp.path(), "acme/tiny", None, bare, MODEL);
    assert_eq!(
        hub.resolve_model(&format!("acme/tiny@{bare}")).unwrap(),
        snap
    );
    assert_eq!(
        hub.resolve_model(&format!("acme/tiny@{MAIN}")).unwrap(),
        main
    );
    // An unknown revision is not cached, and says which ref it looked for.
    let err = hub.resolve_model("acme/tiny@v2").unwrap_err().to_string();
    assert!(err.contains("refs/v2"), "{err}");
    assert!(err.contains("--revision v2"), "{err}");
}

#[test]
fn a_missing_repo_offline_names_the_id_the_cache_and_the_fix() {
    let tmp = tempfile::tempdir().unwrap();
    let hub = Hub::new(tmp.path());
    let err = hub.resolve_model("Qwen/Qwen2.5-0.5B-Instruct").unwrap_err();
    assert!(
        matches!(
            err,
            Error::NotCached {
                download_error: None,
                ..
            }
        ),
        "{err:?}"
    );
    let msg = err.to_string();
    for want in [
        "'Qwen/Qwen2.5-0.5B-Instruct'",
        &tmp.path().display().to_string(),
        "models--Qwen--Qwen2.5-0.5B-Instruct",
        "HF_HUB_OFFLINE",
        "huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct",
        "HF_HOME",
        "local model directory",
    ] {
        assert!(msg.contains(want), "missing {want:?} in: {msg}");
    }
    match hub
        .locate("Qwen/Qwen2.5-0.5B-Instruct", Need::Model)
        .unwrap()
    {
        Located::NotCached { cache, why, .. } => {
            assert_eq!(cache, tmp.path());
            assert!(why.contains("models--Qwen--Qwen2.5-0.5B-Instruct"), "{why}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn invalid_specs_are_refused_clearly() {
    let tmp = tempfile::tempdir().unwrap();
    let hub = Hub::new(tmp.path()).online(true);
    for (spec, why) in [
        ("../x", "'..'"),
        ("a/b/c", "'owner/name'"),
        ("", "empty"),
        ("/no/such/dir", "path"),
        ("a/b@", "revision"),
    ] {
        let err = hub.resolve_model(spec).unwrap_err();
        assert!(
            matches!(err, Error::InvalidSpec { .. }),
            "{spec:?}: {err:?}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains("neither an existing directory nor a Hugging Face repo id"),
            "{msg}"
        );
        assert!(msg.contains(why), "{spec:?}: {msg}");
        assert!(!rlhf_hub::is_repo_id(spec));
    }
}

#[test]
fn a_snapshot_without_weights_is_not_a_model() {
    let tmp = tempfile::tempdir().unwrap();
    let hub = Hub::new(tmp.path());
    add(
        tmp.path(),
        "acme/noweights",
        Some("main"),
        MAIN,
        &["config.json", "tokenizer.json"],
    );
    let err = hub.resolve_model("acme/noweights").unwrap_err().to_string();
    assert!(err.contains("lacks model.safetensors"), "{err}");
    // ... but it is a tokenizer, and a config.
    assert!(hub.resolve_tokenizer("acme/noweights").is_ok());
    assert!(hub.resolve("acme/noweights", Need::Config).is_ok());

    add(
        tmp.path(),
        "acme/noconfig",
        Some("main"),
        MAIN,
        &["model.safetensors"],
    );
    let err = hub.resolve_model("acme/noconfig").unwrap_err().to_string();
    assert!(err.contains("lacks config.json"), "{err}");

    // A sharded checkpoint counts only with every shard of its index.
    let src = tempfile::tempdir().unwrap();
    let index = src.path().join("index.json");
    std::fs::write(
        &index,
        r#"{"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors", "c": "model-00001-of-00002.safetensors"}}"#,
    )
    .unwrap();
    let f = files(
        src.path(),
        &[
            "config.json",
            "model-00001-of-00002.safetensors",
            "model-00002-of-00002.safetensors",
        ],
    );
    let part: Vec<(&str, &Path)> = vec![
        (f[0].0.as_str(), f[0].1.as_path()),
        (f[1].0.as_str(), f[1].1.as_path()),
        ("model.safetensors.index.json", index.as_path()),
    ];
    add_snapshot(tmp.path(), "acme/sharded", Some("main"), MAIN, &part).unwrap();
    let err = hub.resolve_model("acme/sharded").unwrap_err().to_string();
    assert!(err.contains("model-00002-of-00002.safetensors"), "{err}");
    add_snapshot(
        tmp.path(),
        "acme/sharded",
        Some("main"),
        MAIN,
        &[(f[2].0.as_str(), f[2].1.as_path())],
    )
    .unwrap();
    assert!(hub.resolve_model("acme/sharded").is_ok());

    // A shard index that points outside the snapshot is refused.
    let evil = src.path().join("evil.json");
    std::fs::write(&evil, r#"{"weight_map": {"a": "../../blobs/x"}}"#).unwrap();
    add_snapshot(
        tmp.path(),
        "acme/evil",
        Some("main"),
        MAIN,
        &[
            (f[0].0.as_str(), f[0].1.as_path()),
            ("model.safetensors.index.json", evil.as_path()),
        ],
    )
    .unwrap();
    let err = hub.resolve_model("acme/evil").unwrap_err().to_string();
    assert!(err.contains("not a plain file name"), "{err}");
}

#[cfg(unix)]
#[test]
fn a_dangling_blob_link_does_not_count() {
    let tmp = tempfile::tempdir().unwrap();
    let snap = add(tmp.path(), "acme/tiny", Some("main"), MAIN, MODEL);
    let blob = std::fs::read_link(snap.join("model.safetensors")).unwrap();
    std::fs::remove_file(snap.join(&blob)).unwrap();
    let err = Hub::new(tmp.path())
        .resolve_model("acme/tiny")
        .unwrap_err()
        .to_string();
    assert!(err.contains("lacks model.safetensors"), "{err}");
}

#[test]
fn an_existing_directory_is_itself() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("acme").join("tiny");
    std::fs::create_dir_all(&dir).unwrap();
    let hub = Hub::new(tmp.path().join("empty-cache"));
    let spec = dir.to_string_lossy().into_owned();
    assert_eq!(hub.resolve_model(&spec).unwrap(), dir);
    assert_eq!(
        hub.locate(&spec, Need::Model).unwrap(),
        Located::Directory(dir.clone())
    );
}

/// A fake Hub: answers GETs from a table, counts the requests per path.
struct FakeHub {
    endpoint: String,
    hits: Arc<Mutex<HashMap<String, usize>>>,
    /// The Authorization header of each request, in order.
    auth: Arc<Mutex<Vec<Option<String>>>>,
}

fn serve(routes: HashMap<String, (u16, Vec<u8>)>) -> FakeHub {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let hits = Arc::new(Mutex::new(HashMap::new()));
    let counted = hits.clone();
    let auth = Arc::new(Mutex::new(Vec::new()));
    let seen = auth.clone();
    let routes = Arc::new(routes);
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let routes = routes.clone();
            let counted = counted.clone();
            let seen = seen.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                let mut line = String::new();
                reader.read_line(&mut line).unwrap();
                let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
                let mut authorization = None;
                loop {
                    let mut h = String::new();
                    if reader.read_line(&mut h).unwrap() == 0 || h == "\r\n" {
                        break;
                    }
                    if let Some((k, v)) = h.split_once(':') {
                        if k.eq_ignore_ascii_case("authorization") {
                            authorization = Some(v.trim().to_string());
                        }
                    }
                }
                seen.lock().unwrap().push(authorization);
                *counted.lock().unwrap().entry(path.clone()).or_insert(0) += 1;
                let (status, body) = routes
                    .get(&path)
                    .cloned()
                    .unwrap_or((404, b"not found".to_vec()));
                let head = format!(
                    "HTTP/1.1 {status} X\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                    body.len()
                );
                let _ = stream.write_all(head.as_bytes());
                let _ = stream.write_all(&body);
            });
        }
    });
    FakeHub {
        endpoint,
        hits,
        auth,
    }
}

const COMMIT: &str = "abcdefabcdefabcdefabcdefabcdefabcdefabcd";

/// A repo listing with blob ids as the Hub's `?blobs=true` gives them.
fn listing(files: &[(&str, &[u8], bool)]) -> Vec<u8> {
    let siblings: Vec<serde_json::Value> = files
        .iter()
        .enumerate()
        .map(|(i, (name, body, lfs))| {
            let mut s = serde_json::json!({
                "rfilename": name,
                "blobId": format!("{:040x}", i + 1),
                "size": body.len(),
            });
            if *lfs {
                s["lfs"] =
                    serde_json::json!({"sha256": format!("{:064x}", i + 100), "size": body.len()});
            }
            s
        })
        .collect();
    serde_json::json!({"id": "acme/tiny", "sha": COMMIT, "siblings": siblings})
        .to_string()
        .into_bytes()
}

fn fake_repo() -> (FakeHub, Vec<(&'static str, Vec<u8>)>) {
    let index = br#"{"metadata": {}, "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}"#.to_vec();
    let files: Vec<(&'static str, Vec<u8>, bool)> = vec![
        (
            "config.json",
            b"{\"model_type\": \"llama\"}".to_vec(),
            false,
        ),
        ("tokenizer.json", b"{\"tok\": 1}".to_vec(), false),
        ("tokenizer_config.json", b"{}".to_vec(), false),
        ("generation_config.json", b"{}".to_vec(), false),
        ("model.safetensors.index.json", index, false),
        ("model-00001-of-00002.safetensors", vec![1u8; 1000], true),
        ("model-00002-of-00002.safetensors", vec![2u8; 500], true),
        ("README.md", b"not fetched".to_vec(), false),
        ("pytorch_model.bin", b"not fetched".to_vec(), true),
    ];
    let list: Vec<(&str, &[u8], bool)> = files
        .iter()
        .map(|(n, b, l)| (*n, b.as_slice(), *l))
        .collect();
    let mut routes = HashMap::new();
    routes.insert(
        "/api/models/acme/tiny/revision/main?blobs=true".to_string(),
        (200, listing(&list)),
    );
    for (name, body, _) in &files {
        routes.insert(
            format!("/acme/tiny/resolve/{COMMIT}/{name}"),
            (200, body.clone()),
        );
    }
    let fake = serve(routes);
    (fake, files.into_iter().map(|(n, b, _)| (n, b)).collect())
}

#[test]
fn downloads_land_in_the_cache_layout_once() {
    let (fake, files) = fake_repo();
    let tmp = tempfile::tempdir().unwrap();
    let hub = Hub::new(tmp.path())
        .online(true)
        .with_endpoint(fake.endpoint.clone())
        .with_log(|_| {});
    // Two resolvers at once (as the roles of one node): one downloads, the other waits.
    let dirs: Vec<PathBuf> = std::thread::scope(|s| {
        let a = s.spawn(|| hub.resolve_model("acme/tiny"));
        let b = s.spawn(|| hub.resolve_model("acme/tiny"));
        vec![a.join().unwrap().unwrap(), b.join().unwrap().unwrap()]
    });
    let repo_dir = tmp.path().join("models--acme--tiny");
    let snap = repo_dir.join("snapshots").join(COMMIT);
    assert_eq!(dirs, vec![snap.clone(), snap.clone()]);
    assert_eq!(
        std::fs::read_to_string(repo_dir.join("refs").join("main")).unwrap(),
        COMMIT
    );
    for (name, body) in &files {
        let p = snap.join(name);
        if name.ends_with(".md") || name.ends_with(".bin") {
            assert!(!p.exists(), "{name} should not be fetched");
            continue;
        }
        assert_eq!(&std::fs::read(&p).unwrap(), body, "{name}");
        #[cfg(unix)]
        {
            let link = std::fs::read_link(&p).unwrap();
            assert!(
                link.starts_with("../../blobs"),
                "{name}: {}",
                link.display()
            );
        }
    }
    // LFS files are stored under their sha256, the others under their blob id.
    assert!(repo_dir
        .join("blobs")
        .join(format!("{:064x}", 105))
        .is_file());
    assert!(repo_dir.join("blobs").join(format!("{:040x}", 1)).is_file());
    let hits = fake.hits.lock().unwrap().clone();
    for (path, n) in &hits {
        assert_eq!(*n, 1, "{path} fetched {n} times: {hits:?}");
    }
    // The cache now answers offline, with no request.
    let offline = Hub::new(tmp.path());
    assert_eq!(offline.resolve_model("acme/tiny").unwrap(), snap);
    assert_eq!(fake.hits.lock().unwrap().len(), hits.len());
}

#[test]
fn a_tokenizer_download_fetches_no_weights_and_a_later_model_completes_it() {
    let (fake, _) = fake_repo();
    let tmp = tempfile::tempdir().unwrap();
    let hub = Hub::new(tmp.path())
        .online(true)
        .with_endpoint(fake.endpoint.clone())
        .with_log(|_| {});
    let dir = hub.resolve_tokenizer("acme/tiny").unwrap();
    assert!(dir.join("tokenizer.json").is_file());
    assert!(!dir.join("model.safetensors.index.json").exists());
    assert!(fake
        .hits
        .lock()
        .unwrap()
        .keys()
        .all(|p| !p.contains("safetensors")));
    assert!(Hub::new(tmp.path()).resolve_model("acme/tiny").is_err());
    assert_eq!(hub.resolve_model("acme/tiny").unwrap(), dir);
}

#[test]
fn a_failed_download_names_the_id_the_cache_and_the_cause() {
    let fake = serve(HashMap::new());
    let tmp = tempfile::tempdir().unwrap();
    let hub = Hub::new(tmp.path())
        .online(true)
        .with_endpoint(fake.endpoint.clone())
        .with_log(|_| {});
    let err = hub.resolve_model("acme/missing").unwrap_err();
    let msg = err.to_string();
    assert!(
        matches!(
            err,
            Error::NotCached {
                download_error: Some(_),
                ..
            }
        ),
        "{msg}"
    );
    for want in [
        "'acme/missing'",
        &tmp.path().display().to_string(),
        "downloading it failed",
        "HTTP 404",
        "huggingface-cli download acme/missing",
    ] {
        assert!(msg.contains(want), "missing {want:?} in: {msg}");
    }
}

#[test]
fn a_repo_without_safetensors_is_refused_at_download() {
    let mut routes = HashMap::new();
    let list = listing(&[
        ("config.json", b"{}", false),
        ("pytorch_model.bin", b"x", true),
    ]);
    routes.insert(
        "/api/models/acme/tiny/revision/main?blobs=true".to_string(),
        (200, list),
    );
    let fake = serve(routes);
    let tmp = tempfile::tempdir().unwrap();
    let err = Hub::new(tmp.path())
        .online(true)
        .with_endpoint(fake.endpoint.clone())
        .with_log(|_| {})
        .resolve_model("acme/tiny")
        .unwrap_err()
        .to_string();
    assert!(err.contains("only safetensors"), "{err}");
    assert!(err.contains("pytorch_model.bin"), "{err}");
}

#[test]
fn a_short_download_is_not_kept() {
    let mut routes = HashMap::new();
    let list = listing(&[
        ("config.json", b"{\"a\": 1}", false),
        ("model.safetensors", b"0123456789", true),
    ]);
    routes.insert(
        "/api/models/acme/tiny/revision/main?blobs=true".to_string(),
        (200, list),
    );
    routes.insert(
        format!("/acme/tiny/resolve/{COMMIT}/config.json"),
        (200, b"{\"a\": 1}".to_vec()),
    );
    // Fewer bytes than the listing announces.
    routes.insert(
        format!("/acme/tiny/resolve/{COMMIT}/model.safetensors"),
        (200, b"01234".to_vec()),
    );
    let fake = serve(routes);
    let tmp = tempfile::tempdir().unwrap();
    let err = Hub::new(tmp.path())
        .online(true)
        .with_endpoint(fake.endpoint.clone())
        .with_log(|_| {})
        .resolve_model("acme/tiny")
        .unwrap_err()
        .to_string();
    assert!(err.contains("got 5 bytes, expected 10"), "{err}");
    let blobs = tmp.path().join("models--acme--tiny").join("blobs");
    let left: Vec<String> = std::fs::read_dir(&blobs)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        left.iter().all(|n| !n.contains("incomplete")) && left.len() == 1,
        "{left:?}"
    );
}

#[test]
fn a_token_goes_as_a_bearer_header_and_none_without_one() {
    let (fake, _) = fake_repo();
    let tmp = tempfile::tempdir().unwrap();
    Hub::new(tmp.path())
        .online(true)
        .with_endpoint(fake.endpoint.clone())
        .with_token(Some("hf_secret".into()))
        .with_log(|_| {})
        .resolve("acme/tiny", Need::Config)
        .unwrap();
    let auth = fake.auth.lock().unwrap().clone();
    assert!(!auth.is_empty());
    assert!(
        auth.iter()
            .all(|a| a.as_deref() == Some("Bearer hf_secret")),
        "{auth:?}"
    );
    // The token never shows in the hub's Debug output.
    let hub = Hub::new(tmp.path()).with_token(Some("hf_secret".into()));
    assert!(!format!("{hub:?}").contains("hf_secret"));

    let (fake, _) = fake_repo();
    let tmp = tempfile::tempdir().unwrap();
    Hub::new(tmp.path())
        .online(true)
        .with_endpoint(fake.endpoint.clone())
        .with_log(|_| {})
        .resolve("acme/tiny", Need::Config)
        .unwrap();
    assert!(fake.auth.lock().unwrap().iter().all(Option::is_none));
}
