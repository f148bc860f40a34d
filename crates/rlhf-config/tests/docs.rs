//! The committed key reference matches the code, every key is documented, and every relative
//! link in README.md and docs/*.md points at a file that exists.

use std::path::Path;

use rlhf_config::docs::{config_reference_markdown, doc_of, leaves, KEY_DOCS, MODEL_KEY_DOCS};

#[test]
fn committed_config_readme_matches_generated() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/README.md");
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    let generated = config_reference_markdown();
    assert!(
        committed == generated,
        "configs/README.md is stale; run `cargo run -p rlhf-config --example gen_config_docs`"
    );
}

#[test]
fn every_key_has_a_doc_and_every_doc_a_key() {
    let schema = rlhf_config::config_schema();
    let paths: Vec<String> = leaves(&schema).into_iter().map(|(p, _)| p).collect();
    for p in &paths {
        assert!(doc_of(p).is_some(), "no doc for {p}");
    }
    for (p, _) in KEY_DOCS {
        assert!(
            paths.iter().any(|x| x == p),
            "KEY_DOCS names unknown key {p}"
        );
    }
    let model = serde_norway::to_value(rlhf_config::ModelConfig::default()).unwrap();
    let model_paths: Vec<String> = leaves(&model).into_iter().map(|(p, _)| p).collect();
    assert_eq!(model_paths.len(), MODEL_KEY_DOCS.len());
    for (p, _) in MODEL_KEY_DOCS {
        assert!(
            model_paths.iter().any(|x| x == p),
            "MODEL_KEY_DOCS names unknown key {p}"
        );
    }
    let md = config_reference_markdown();
    assert!(!md.contains("(undocumented)"));
    assert!(md.contains("| `actor_rollout.ppo_epochs` | `1` |"));
    assert!(md.contains("| `algorithm.kl_ctrl.kl_coef` | `0.05` |"));
}

/// The relative link targets of a markdown text: `[text](target)` outside fenced code blocks,
/// without web or mail addresses, in-page anchors and the `#anchor` part.
fn relative_links(markdown: &str) -> Vec<String> {
    let mut links = Vec::new();
    let mut fenced = false;
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if fenced {
            continue;
        }
        let mut rest = line;
        while let Some(at) = rest.find("](") {
            rest = &rest[at + 2..];
            let Some(end) = rest.find(')') else { break };
            let target = rest[..end].trim();
            rest = &rest[end..];
            let path = target.split('#').next().unwrap_or("");
            if path.is_empty() || target.contains("://") || target.starts_with("mailto:") {
                continue;
            }
            links.push(path.to_string());
        }
    }
    links
}

#[test]
fn every_relative_link_in_readme_and_docs_points_at_a_file() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut files = vec![root.join("README.md")];
    let docs = std::fs::read_dir(root.join("docs")).expect("docs/ is readable");
    for entry in docs {
        let path = entry.expect("a docs/ entry").path();
        if path.extension().is_some_and(|e| e == "md") {
            files.push(path);
        }
    }
    files.sort();
    let mut checked = 0;
    let mut broken = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).expect("a readable markdown file");
        let dir = file.parent().expect("a file has a directory");
        for link in relative_links(&text) {
            checked += 1;
            if !dir.join(&link).exists() {
                let name = file.strip_prefix(&root).unwrap_or(file).display();
                broken.push(format!("{name}: {link}"));
            }
        }
    }
    assert!(
        broken.is_empty(),
        "links to missing files:\n{}",
        broken.join("\n")
    );
    // README and the docs link each other; far fewer means the parser or the glob broke.
    assert!(
        files.len() >= 10,
        "only {} markdown files found",
        files.len()
    );
    assert!(checked >= 60, "only {checked} relative links found");
}

#[test]
fn relative_links_are_found_and_addresses_left_out() {
    let md = "See [a](docs/a.md#x), [b](../b.md) and [web](https://example.org/c.md).\n\
              [top](#anchor) [mail](mailto:x@example.org)\n```\n[code](not/a/link.md)\n```\n";
    assert_eq!(relative_links(md), ["docs/a.md", "../b.md"]);
}
