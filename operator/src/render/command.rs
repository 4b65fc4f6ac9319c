//! The `render` command.

use std::io::Read;
use std::path::Path;
use std::process::ExitCode;

use anyhow::Context as _;
use kube::ResourceExt;
use serde_json::Value;

use crate::crd::{self, SBProxy, SBProxyConfig};

use super::{RenderOptions, fresh_cluster_key, render};

/// The `render` command: reads SBProxy and SBProxyConfig documents from every
/// `-f` file and prints, for each SBProxy, exactly the objects `run` would
/// apply (a cluster-key Secret with a freshly generated key). A refusal is
/// printed on stderr and the exit status is 1.
pub fn command(args: &crate::cli::RenderArgs) -> anyhow::Result<ExitCode> {
    let mut proxies = Vec::new();
    let mut configs = Vec::new();
    let mut skipped = Vec::new();
    for file in &args.files {
        let text = read_input(file)?;
        for (index, doc) in yaml_documents(&text)
            .with_context(|| format!("{}: not a YAML stream", file.display()))?
            .into_iter()
            .enumerate()
        {
            let at = format!("{} (document {})", file.display(), index + 1);
            let Some(kind) = doc.get("kind").and_then(Value::as_str) else {
                anyhow::bail!(
                    "{at}: a document without a kind; render reads SBProxy and SBProxyConfig ({})",
                    crd::API_VERSION
                );
            };
            // Other kinds of a `kubectl apply -f` bundle (the admin Secret,
            // a Certificate) are the user's to apply: skipped.
            if kind != "SBProxy" && kind != "SBProxyConfig" {
                let name = doc
                    .pointer("/metadata/name")
                    .and_then(Value::as_str)
                    .unwrap_or("(no name)");
                skipped.push(format!("{kind} {name} ({at})"));
                continue;
            }
            if let Err(problems) = crd::validate(&doc) {
                anyhow::bail!("{at}: the {kind} is not valid:\n{}", problems.join("\n"));
            }
            if kind == "SBProxy" {
                let mut proxy: SBProxy =
                    serde_json::from_value(doc).with_context(|| format!("{at}: not an SBProxy"))?;
                proxy
                    .metadata
                    .namespace
                    .get_or_insert_with(|| "default".to_string());
                proxies.push((at, proxy));
            } else {
                let mut config: SBProxyConfig = serde_json::from_value(doc)
                    .with_context(|| format!("{at}: not an SBProxyConfig"))?;
                config
                    .metadata
                    .namespace
                    .get_or_insert_with(|| "default".to_string());
                configs.push(config);
            }
        }
    }
    if !skipped.is_empty() {
        eprintln!(
            "note: skipped {} document(s) of other kinds, which render does not read (it renders SBProxy and SBProxyConfig; apply the rest yourself): {}",
            skipped.len(),
            skipped.join(", ")
        );
    }
    if proxies.is_empty() {
        anyhow::bail!("no SBProxy document in the files given; nothing to render");
    }

    let mut out = String::new();
    let mut refused = false;
    for (at, proxy) in &proxies {
        if proxy
            .metadata
            .name
            .as_deref()
            .unwrap_or_default()
            .is_empty()
        {
            anyhow::bail!("{at}: the SBProxy has no metadata.name");
        }
        let config = configs.iter().find(|c| {
            c.metadata
                .name
                .as_deref()
                .is_some_and(|n| proxy.spec.config_ref.name() == Ok(n))
                && c.metadata.namespace == proxy.metadata.namespace
        });
        let opts = RenderOptions {
            sidecar_image: args.sidecar_image.clone(),
            fresh_cluster_key: fresh_cluster_key(),
        };
        match render(proxy, config, None, &opts) {
            Ok(rendered) => out.push_str(&rendered.objects_yaml()),
            Err(refusal) => {
                eprintln!(
                    "SBProxy {}/{} refused ({}): {}",
                    proxy.namespace().unwrap_or_default(),
                    proxy.name_any(),
                    refusal.reason.as_str(),
                    refusal.message
                );
                refused = true;
            }
        }
    }
    if refused {
        return Ok(ExitCode::FAILURE);
    }
    crate::cli::print_out(&out)
}

/// The text of `path`, or of stdin for `-`.
pub(crate) fn read_input(path: &Path) -> anyhow::Result<String> {
    if path.as_os_str() == "-" {
        let mut text = String::new();
        std::io::stdin()
            .read_to_string(&mut text)
            .context("cannot read stdin")?;
        Ok(text)
    } else {
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))
    }
}

/// The documents of a YAML stream, as JSON; empty documents are skipped.
pub(crate) fn yaml_documents(text: &str) -> anyhow::Result<Vec<Value>> {
    use serde::Deserialize as _;
    let mut docs = Vec::new();
    for (index, doc) in serde_norway::Deserializer::from_str(text).enumerate() {
        let value = Value::deserialize(doc)
            .with_context(|| format!("document {}: not valid YAML", index + 1))?;
        if !value.is_null() {
            docs.push(value);
        }
    }
    Ok(docs)
}
