//! Conversations: JSON lines of `conversations: [{role, content}]` (or ShareGPT `from`/`value`),
//! rendered with a chat template and tokenized with a Hugging Face `tokenizer.json`. The loss mask
//! covers the assistant turns: their content and the token that ends the turn.

use std::path::Path;

use serde::Deserialize;
use tokenizers::Tokenizer;

use super::jsonl::{FileRead, for_each_record, json_error};
use super::{RawSample, Reason, Sink, Stop};

/// How a conversation is rendered to text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Template {
    /// `<|im_start|>{role}\n{content}<|im_end|>\n` per turn (Qwen and others).
    ChatMl,
    /// `<|begin_of_text|>` then `<|start_header_id|>{role}<|end_header_id|>\n\n{content}<|eot_id|>`
    /// per turn, content trimmed (Llama 3).
    Llama3,
}

impl Template {
    pub fn name(self) -> &'static str {
        match self {
            Template::ChatMl => "chatml",
            Template::Llama3 => "llama3",
        }
    }

    /// Special tokens the template writes; the tokenizer must know each as one token.
    fn special_tokens(self) -> &'static [&'static str] {
        match self {
            Template::ChatMl => &["<|im_start|>", "<|im_end|>"],
            Template::Llama3 => &[
                "<|begin_of_text|>",
                "<|start_header_id|>",
                "<|end_header_id|>",
                "<|eot_id|>",
            ],
        }
    }

    /// Renders turns to text; returns the byte spans that carry loss (assistant content plus the
    /// end-of-turn token).
    pub fn render(self, turns: &[(Role, &str)]) -> (String, Vec<(usize, usize)>) {
        let mut text = String::new();
        let mut spans = Vec::new();
        if self == Template::Llama3 {
            text.push_str("<|begin_of_text|>");
        }
        for &(role, content) in turns {
            let (content, newline) = match self {
                Template::ChatMl => (content, "\n"),
                Template::Llama3 => (content.trim(), ""),
            };
            let (header, end) = (self.header(role), self.end_token());
            text.push_str(&header);
            let start = text.len();
            text.push_str(content);
            text.push_str(end);
            if role == Role::Assistant {
                spans.push((start, text.len()));
            }
            text.push_str(newline);
        }
        (text, spans)
    }
}

impl Template {
    /// The token that ends a turn.
    pub fn end_token(self) -> &'static str {
        match self {
            Template::ChatMl => "<|im_end|>",
            Template::Llama3 => "<|eot_id|>",
        }
    }

    /// The text that opens a turn of `role`.
    fn header(self, role: Role) -> String {
        match self {
            Template::ChatMl => format!("<|im_start|>{}\n", role.name()),
            Template::Llama3 => format!("<|start_header_id|>{}<|end_header_id|>\n\n", role.name()),
        }
    }

    /// The template as text (every role's header and the end of a turn): what its hash in a
    /// generate's metadata identifies.
    pub fn text(self) -> String {
        let mut text = String::from(match self {
            Template::ChatMl => "",
            Template::Llama3 => "<|begin_of_text|>",
        });
        for role in [Role::System, Role::User, Role::Assistant] {
            text.push_str(&self.header(role));
            text.push_str("{content}");
            text.push_str(self.end_token());
        }
        text
    }

    /// The text that opens the assistant's turn: what a prompt ends with to ask for a reply.
    pub fn assistant_header(self) -> String {
        self.header(Role::Assistant)
    }
}

impl std::str::FromStr for Template {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "chatml" => Ok(Template::ChatMl),
            "llama3" => Ok(Template::Llama3),
            _ => Err(format!(
                "unknown chat template {s:?} (expected chatml or llama3)"
            )),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    System,
    User,
    Assistant,
}

impl Role {
    pub fn name(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }

    fn parse(s: &str) -> Option<Role> {
        match s {
            "system" => Some(Role::System),
            "user" | "human" => Some(Role::User),
            "assistant" | "gpt" => Some(Role::Assistant),
            _ => None,
        }
    }
}

/// A tokenizer and a template, checked to fit each other.
pub struct ChatEncoder {
    tokenizer: Tokenizer,
    template: Template,
}

/// Loads a Hugging Face `tokenizer.json`.
pub fn load_tokenizer(path: &Path) -> Result<Tokenizer, String> {
    Tokenizer::from_file(path)
        .map_err(|e| format!("{}: not a usable tokenizer.json: {e}", path.display()))
}

impl ChatEncoder {
    /// Pairs a tokenizer with a template, checking that it knows the template's special tokens.
    pub fn new(
        tokenizer: Tokenizer,
        tokenizer_path: &Path,
        template: Template,
    ) -> Result<Self, String> {
        for token in template.special_tokens() {
            if tokenizer.token_to_id(token).is_none() {
                return Err(format!(
                    "{}: has no {token} token, so it does not fit --chat-template {}",
                    tokenizer_path.display(),
                    template.name()
                ));
            }
        }
        Ok(Self {
            tokenizer,
            template,
        })
    }

    /// Token ids and loss mask of a conversation: a token carries loss when it lies wholly inside
    /// an assistant span.
    pub fn encode(&self, turns: &[(Role, &str)]) -> Result<RawSample, String> {
        let (text, spans) = self.template.render(turns);
        let encoding = self
            .tokenizer
            .encode(text.as_str(), false)
            .map_err(|e| format!("tokenizer failed: {e}"))?;
        let loss_mask = encoding
            .get_offsets()
            .iter()
            .map(|&(start, end)| u8::from(spans.iter().any(|&(s, e)| s <= start && end <= e)))
            .collect();
        Ok(RawSample {
            input_ids: encoding.get_ids().to_vec(),
            loss_mask: Some(loss_mask),
        })
    }
}

impl ChatEncoder {
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The id of the token that ends the template's turns.
    pub fn end_token_id(&self) -> Option<u32> {
        self.tokenizer.token_to_id(self.template.end_token())
    }

    /// Token ids of a prompt asking for the assistant's reply after `turns` (trailing
    /// assistant turns dropped: they are what the reply replaces).
    pub fn encode_prompt(&self, turns: &[(Role, &str)]) -> Result<Vec<u32>, String> {
        let keep = turns
            .iter()
            .rposition(|(role, _)| *role != Role::Assistant)
            .map_or(0, |i| i + 1);
        let (mut text, _) = self.template.render(&turns[..keep]);
        text.push_str(&self.template.assistant_header());
        let encoding = self
            .tokenizer
            .encode(text.as_str(), false)
            .map_err(|e| format!("tokenizer failed: {e}"))?;
        Ok(encoding.get_ids().to_vec())
    }
}

#[derive(Deserialize)]
struct Turn {
    #[serde(default)]
    role: Option<String>,
    #[serde(default)]
    from: Option<String>,
    #[serde(default)]
    content: Option<serde_json::Value>,
    #[serde(default)]
    value: Option<serde_json::Value>,
}

#[derive(Deserialize)]
struct Conversation {
    #[serde(default)]
    conversations: Option<Vec<Turn>>,
    #[serde(default)]
    messages: Option<Vec<Turn>>,
}

/// The turns of one conversation record, or why it is not one.
pub fn parse_conversation(line: &[u8]) -> Result<Vec<(Role, String)>, (Reason, String)> {
    let record: Conversation = serde_json::from_slice(line).map_err(|e| json_error(&e))?;
    let turns = record
        .conversations
        .or(record.messages)
        .ok_or((Reason::MissingField, "no conversations".to_owned()))?;
    if turns.is_empty() {
        return Err((Reason::BadConversation, "conversations is empty".into()));
    }
    turns
        .into_iter()
        .enumerate()
        .map(|(i, turn)| {
            let role_name = turn.role.or(turn.from).ok_or((
                Reason::BadConversation,
                format!("conversations[{i}] has no role (or from)"),
            ))?;
            let role = Role::parse(&role_name).ok_or_else(|| {
                (
                    Reason::UnknownRole,
                    format!(
                        "conversations[{i}] has unknown role {role_name:?} (expected system, user, \
                         assistant, or ShareGPT human, gpt)"
                    ),
                )
            })?;
            match turn.content.or(turn.value) {
                Some(serde_json::Value::String(text)) => Ok((role, text)),
                Some(other) => Err((
                    Reason::BadConversation,
                    format!("conversations[{i}] content is not a string: {other}"),
                )),
                None => Err((
                    Reason::BadConversation,
                    format!("conversations[{i}] has no content (or value)"),
                )),
            }
        })
        .collect()
}

/// Reads a file of conversations into `sink` (tokenizing on two threads).
pub fn read_chat(
    path: &Path,
    encoder: &ChatEncoder,
    sink: &mut dyn Sink,
) -> Result<FileRead, Stop> {
    let parse = |line: &[u8]| {
        let turns = parse_conversation(line)?;
        let borrowed: Vec<(Role, &str)> = turns.iter().map(|(r, t)| (*r, t.as_str())).collect();
        encoder
            .encode(&borrowed)
            .map_err(|message| (Reason::BadConversation, message))
    };
    for_each_record(path, sink, parse, |at, parsed, sink| match parsed {
        Ok(sample) => sink.accept(at, sample),
        Err((reason, message)) => sink.reject(at, reason, message),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_spans_cover_assistant_content_and_end_token() {
        let turns = [(Role::User, "hi"), (Role::Assistant, "hello")];
        let (text, spans) = Template::ChatMl.render(&turns);
        assert_eq!(
            text,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n"
        );
        assert_eq!(&text[spans[0].0..spans[0].1], "hello<|im_end|>");
    }

    #[test]
    fn llama3_trims_content() {
        let turns = [(Role::System, " be brief \n"), (Role::Assistant, "\n ok ")];
        let (text, spans) = Template::Llama3.render(&turns);
        assert!(text.starts_with(
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nbe brief<|eot_id|>"
        ));
        assert_eq!(&text[spans[0].0..spans[0].1], "ok<|eot_id|>");
    }

    #[test]
    fn parses_both_conversation_layouts_and_rejects_bad_ones() {
        let t = parse_conversation(br#"{"conversations":[{"role":"user","content":"a"},{"role":"assistant","content":"b"}]}"#).unwrap();
        assert_eq!(
            t,
            vec![(Role::User, "a".into()), (Role::Assistant, "b".into())]
        );
        let t = parse_conversation(
            br#"{"conversations":[{"from":"human","value":"a"},{"from":"gpt","value":"b"}]}"#,
        )
        .unwrap();
        assert_eq!(
            t,
            vec![(Role::User, "a".into()), (Role::Assistant, "b".into())]
        );
        let err = |l: &str| parse_conversation(l.as_bytes()).unwrap_err();
        let (r, m) = err(r#"{"conversations":[{"role":"tool","content":"x"}]}"#);
        assert_eq!(r, Reason::UnknownRole);
        assert!(m.contains("\"tool\""), "{m}");
        assert_eq!(err(r#"{"conversations":[]}"#).0, Reason::BadConversation);
        assert_eq!(
            err(r#"{"conversations":[{"role":"user"}]}"#).0,
            Reason::BadConversation
        );
        assert_eq!(
            err(r#"{"conversations":[{"role":"user","content":[1]}]}"#).0,
            Reason::BadConversation
        );
        assert_eq!(err(r#"{"text":"x"}"#).0, Reason::MissingField);
        assert_eq!(err(r#"{"conversations":"#).0, Reason::MalformedJson);
    }
}
