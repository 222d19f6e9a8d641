//! Responses from an OpenAI-compatible server the user already runs (SGLang, vLLM): chat
//! completions for conversations, completions from token ids for pre-tokenized prompts.

use std::time::Duration;

use serde_json::{Value, json};

use crate::ingest::chat::Role;

/// A server and the model it serves.
pub struct Server {
    agent: ureq::Agent,
    base: String,
    pub model: String,
}

/// One response: its text and whether it ended by itself (not at the token limit).
pub struct Reply {
    pub text: String,
    pub finished: bool,
}

fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder()
        .timeout_global(Some(timeout))
        .http_status_as_error(false)
        .build()
        .into()
}

/// The largest answer read from a server: far above any reply of --max-new-tokens tokens (which
/// are cut to that many after tokenising), far below what would strain memory.
pub const BODY_LIMIT: u64 = 64 << 20;

/// The most of a server's answer an error message quotes.
const QUOTED: usize = 300;

fn read_body(response: &mut ureq::http::Response<ureq::Body>) -> Result<String, ureq::Error> {
    response
        .body_mut()
        .with_config()
        .limit(BODY_LIMIT)
        .read_to_string()
}

fn clip(text: &str) -> String {
    crate::format::clip(text, QUOTED)
}

impl Server {
    /// Connects: the server must answer `GET /v1/models`; `model` defaults to the first it
    /// lists.
    pub fn connect(url: &str, model: Option<&str>, timeout: Duration) -> Result<Self, String> {
        let base = url.trim_end_matches('/').trim_end_matches("/v1").to_owned();
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(format!("--server {url:?}: expected an http:// URL"));
        }
        if base.starts_with("https://") {
            return Err(format!(
                "--server {url:?}: this build speaks plain http (a server on this machine or \
                 behind a local tunnel)"
            ));
        }
        let probe = agent(Duration::from_secs(10));
        let listed = probe
            .get(&format!("{base}/v1/models"))
            .call()
            .map_err(|e| format!("cannot reach --server {url}: {e}"))
            .and_then(|mut r| {
                let status = r.status();
                let body = read_body(&mut r).unwrap_or_default();
                if status.is_success() {
                    serde_json::from_str::<Value>(&body)
                        .map_err(|e| format!("--server {url}: /v1/models did not answer JSON: {e}"))
                } else {
                    Err(format!(
                        "--server {url}: /v1/models answered {status}: {}",
                        clip(body.trim())
                    ))
                }
            })?;
        let model = match model {
            Some(m) => m.to_owned(),
            None => listed["data"][0]["id"]
                .as_str()
                .ok_or_else(|| format!("--server {url}: lists no model; pass --server-model NAME"))?
                .to_owned(),
        };
        Ok(Self {
            agent: agent(timeout),
            base,
            model,
        })
    }

    fn post(&self, path: &str, body: &Value) -> Result<Value, String> {
        let mut response = self
            .agent
            .post(&format!("{}{path}", self.base))
            .header("Content-Type", "application/json")
            .send(body.to_string())
            .map_err(|e| format!("--server {}{path}: {e}", self.base))?;
        let status = response.status();
        let text =
            read_body(&mut response).map_err(|e| format!("--server {}{path}: {e}", self.base))?;
        if !status.is_success() {
            return Err(format!(
                "--server {}{path} answered {status}: {}",
                self.base,
                clip(text.trim())
            ));
        }
        serde_json::from_str(&text)
            .map_err(|e| format!("--server {}{path}: not JSON: {e}", self.base))
    }

    fn reply(choice: &Value, field: &str) -> Result<Reply, String> {
        let text = match field {
            "message" => choice["message"]["content"].as_str(),
            _ => choice["text"].as_str(),
        }
        .ok_or_else(|| {
            format!(
                "the server's answer has no {field} text: {}",
                clip(&choice.to_string())
            )
        })?;
        Ok(Reply {
            text: text.to_owned(),
            finished: choice["finish_reason"].as_str() != Some("length"),
        })
    }

    /// The assistant's reply to `turns`.
    pub fn chat(
        &self,
        turns: &[(Role, String)],
        max_tokens: usize,
        temperature: f64,
        seed: u64,
    ) -> Result<Reply, String> {
        let messages: Vec<Value> = turns
            .iter()
            .map(|(role, content)| json!({"role": role.name(), "content": content}))
            .collect();
        let answer = self.post(
            "/v1/chat/completions",
            &json!({
                "model": self.model, "messages": messages, "max_tokens": max_tokens,
                "temperature": temperature, "seed": seed,
            }),
        )?;
        Self::reply(&answer["choices"][0], "message")
    }

    /// The continuation of the token ids `prompt`.
    pub fn complete(
        &self,
        prompt: &[u32],
        max_tokens: usize,
        temperature: f64,
        seed: u64,
    ) -> Result<Reply, String> {
        let answer = self.post(
            "/v1/completions",
            &json!({
                "model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": temperature, "seed": seed,
            }),
        )?;
        Self::reply(&answer["choices"][0], "text")
    }
}
