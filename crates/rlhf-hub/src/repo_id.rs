//! Parsing a model spec as a Hub repo id: `name` or `owner/name`, optionally `@revision`.
//!
//! The rules follow the Hub's own: each part uses ASCII letters, digits, `_`, `-` and `.`,
//! does not start or end with `-` or `.`, holds no `--` or `..`, and the id is at most 96
//! characters. A revision is a branch, a tag or a commit hash: `/`-separated segments of the
//! same characters, none empty, `.` or `..`. Anything else (absolute paths, `../x`, `a/b/c`,
//! backslashes, whitespace) is refused, so an id can never name a path outside the cache.

use std::fmt;

/// Longest repo id (`owner/name`) the Hub accepts.
const MAX_ID_LEN: usize = 96;
/// Longest revision accepted (git refs are short; this only bounds hostile input).
const MAX_REVISION_LEN: usize = 255;

/// A parsed Hub model repo id with its revision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RepoId {
    owner: Option<String>,
    name: String,
    revision: Option<String>,
}

/// Why a spec is not a repo id (a sentence fragment, shown after the spec).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IdError(pub String);

impl fmt::Display for IdError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

fn id_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')
}

fn check_part(part: &str, what: &str) -> Result<(), IdError> {
    if part.is_empty() {
        return Err(IdError(format!("the {what} is empty")));
    }
    if let Some(c) = part.chars().find(|c| !id_char(*c)) {
        return Err(IdError(format!(
            "the {what} '{part}' holds {c:?}; Hub ids use only letters, digits, '_', '-' and '.'"
        )));
    }
    if part.starts_with(['-', '.']) || part.ends_with(['-', '.']) {
        return Err(IdError(format!(
            "the {what} '{part}' starts or ends with '-' or '.'"
        )));
    }
    if part.contains("--") || part.contains("..") {
        return Err(IdError(format!("the {what} '{part}' holds '--' or '..'")));
    }
    Ok(())
}

fn check_revision(rev: &str) -> Result<(), IdError> {
    if rev.is_empty() {
        return Err(IdError("the revision after '@' is empty".into()));
    }
    if rev.len() > MAX_REVISION_LEN {
        return Err(IdError(format!(
            "the revision is longer than {MAX_REVISION_LEN} characters"
        )));
    }
    for seg in rev.split('/') {
        if seg.is_empty() || seg == "." || seg == ".." {
            return Err(IdError(format!(
                "the revision '{rev}' has an empty, '.' or '..' segment"
            )));
        }
        if let Some(c) = seg.chars().find(|c| !id_char(*c)) {
            return Err(IdError(format!(
                "the revision '{rev}' holds {c:?}; revisions use only letters, digits, '_', '-', '.' and '/'"
            )));
        }
    }
    Ok(())
}

/// Whether `s` is a full commit hash (40 lowercase hex digits), which names a snapshot
/// directly.
pub fn is_commit_hash(s: &str) -> bool {
    s.len() == 40
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

impl RepoId {
    /// Parses `name`, `owner/name`, `name@revision` or `owner/name@revision`.
    pub fn parse(spec: &str) -> Result<Self, IdError> {
        if spec.is_empty() {
            return Err(IdError("the model name is empty".into()));
        }
        if spec.starts_with('/') || spec.starts_with('~') || spec.contains('\\') {
            return Err(IdError(
                "it is a path, and a Hub repo id is 'name' or 'owner/name'".into(),
            ));
        }
        let (id, revision) = match spec.split_once('@') {
            Some((id, rev)) => {
                check_revision(rev)?;
                (id, Some(rev.to_string()))
            }
            None => (spec, None),
        };
        if id.len() > MAX_ID_LEN {
            return Err(IdError(format!(
                "a Hub repo id has at most {MAX_ID_LEN} characters"
            )));
        }
        let parts: Vec<&str> = id.split('/').collect();
        let (owner, name) = match parts.as_slice() {
            [name] => (None, *name),
            [owner, name] => (Some(*owner), *name),
            _ => {
                return Err(IdError(format!(
                "'{id}' has {} '/'-separated parts, and a Hub repo id is 'name' or 'owner/name'",
                parts.len()
            )))
            }
        };
        if let Some(owner) = owner {
            check_part(owner, "owner")?;
        }
        check_part(name, "repo name")?;
        Ok(Self {
            owner: owner.map(str::to_string),
            name: name.to_string(),
            revision,
        })
    }

    /// `owner/name` (or `name`), without the revision.
    pub fn id(&self) -> String {
        match &self.owner {
            Some(o) => format!("{o}/{}", self.name),
            None => self.name.clone(),
        }
    }

    /// The revision asked for, `main` when none was.
    pub fn revision(&self) -> &str {
        self.revision.as_deref().unwrap_or("main")
    }

    /// Whether a revision was given explicitly (`@rev`).
    pub fn has_revision(&self) -> bool {
        self.revision.is_some()
    }

    /// The repo's folder in the cache: `models--{owner}--{name}`.
    pub fn folder_name(&self) -> String {
        match &self.owner {
            Some(o) => format!("models--{o}--{}", self.name),
            None => format!("models--{}", self.name),
        }
    }
}

impl fmt::Display for RepoId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.id())?;
        if let Some(r) = &self.revision {
            write!(f, "@{r}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn valid_ids_parse() {
        let r = RepoId::parse("Qwen/Qwen2.5-0.5B-Instruct").unwrap();
        assert_eq!(r.id(), "Qwen/Qwen2.5-0.5B-Instruct");
        assert_eq!(r.revision(), "main");
        assert!(!r.has_revision());
        assert_eq!(r.folder_name(), "models--Qwen--Qwen2.5-0.5B-Instruct");
        let r = RepoId::parse("gpt2").unwrap();
        assert_eq!(r.folder_name(), "models--gpt2");
        let r = RepoId::parse("meta-llama/Llama-3.2-1B@refs/pr/1").unwrap();
        assert_eq!(r.revision(), "refs/pr/1");
        assert_eq!(r.to_string(), "meta-llama/Llama-3.2-1B@refs/pr/1");
        let r = RepoId::parse("a_b/c.d@v1.0").unwrap();
        assert_eq!(r.revision(), "v1.0");
    }

    #[test]
    fn invalid_ids_are_refused_with_a_reason() {
        for (spec, why) in [
            ("", "empty"),
            ("../x", "'..'"),
            ("a/b/c", "3 '/'-separated parts"),
            ("/abs/path", "path"),
            ("~/models/x", "path"),
            ("a\\b", "path"),
            ("a/", "repo name is empty"),
            ("/x", "path"),
            ("a b", "' '"),
            ("owner/-name", "starts or ends"),
            ("owner/name.", "starts or ends"),
            ("ow--ner/name", "'--'"),
            ("a/b@", "revision after '@' is empty"),
            ("a/b@../main", "'..' segment"),
            ("a/b@x//y", "empty"),
            ("a/b@x y", "' '"),
            ("a/b@c@d", "'@'"),
            ("./x", "starts or ends"),
        ] {
            let err = RepoId::parse(spec).unwrap_err().to_string();
            assert!(err.contains(why), "{spec:?}: {err}");
        }
        let long = format!("a/{}", "b".repeat(100));
        assert!(RepoId::parse(&long).is_err());
    }

    #[test]
    fn commit_hashes_are_recognised() {
        assert!(is_commit_hash("0123456789abcdef0123456789abcdef01234567"));
        assert!(!is_commit_hash("0123456789ABCDEF0123456789abcdef01234567"));
        assert!(!is_commit_hash("main"));
        assert!(!is_commit_hash("0123456789abcdef"));
    }
}
