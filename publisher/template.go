package publisher

import (
	"fmt"
	"regexp"
	"strings"

	"github.com/outbox-relay/outbox-relay/event"
)

// topicTemplate is a parsed --topic value: literal text and placeholders.
type topicTemplate struct {
	parts []templatePart
}

type templatePart struct {
	literal string
	field   func(*event.Event) []byte // nil for a literal
}

var templateFields = map[string]func(*event.Event) []byte{
	"aggregate_type": func(e *event.Event) []byte { return e.AggregateType },
	"event_type":     func(e *event.Event) []byte { return e.EventType },
}

func parseTopicTemplate(s string) (*topicTemplate, error) {
	if s == "" {
		return nil, fmt.Errorf("topic template is empty: set --topic, e.g. outbox.event.{aggregate_type}")
	}
	t := &topicTemplate{}
	rest := s
	for rest != "" {
		open := strings.IndexByte(rest, '{')
		if open < 0 {
			t.parts = append(t.parts, templatePart{literal: rest})
			break
		}
		if open > 0 {
			t.parts = append(t.parts, templatePart{literal: rest[:open]})
		}
		end := strings.IndexByte(rest[open:], '}')
		if end < 0 {
			return nil, fmt.Errorf("topic template %q: unclosed '{'", s)
		}
		name := rest[open+1 : open+end]
		field, ok := templateFields[name]
		if !ok {
			return nil, fmt.Errorf("topic template %q: unknown placeholder {%s}; use {aggregate_type} or {event_type}", s, name)
		}
		t.parts = append(t.parts, templatePart{field: field})
		rest = rest[open+end+1:]
	}
	if len(t.parts) == 1 && t.parts[0].field == nil {
		if err := validTopicName(s); err != nil {
			return nil, fmt.Errorf("topic template: %w", err)
		}
	}
	return t, nil
}

func (t *topicTemplate) appendName(dst []byte, ev *event.Event) []byte {
	for _, p := range t.parts {
		if p.field != nil {
			dst = append(dst, p.field(ev)...)
		} else {
			dst = append(dst, p.literal...)
		}
	}
	return dst
}

// validTopicName applies Kafka's rules for topic names.
func validTopicName(name string) error {
	if name == "" || name == "." || name == ".." || len(name) > 249 {
		return fmt.Errorf("%w %q: must be 1 to 249 characters and not '.' or '..'", errInvalidTopicName, name)
	}
	for i := 0; i < len(name); i++ {
		c := name[i]
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '_' || c == '-') {
			return fmt.Errorf("%w %q: only ASCII letters, digits, '.', '_' and '-' are allowed", errInvalidTopicName, name)
		}
	}
	return nil
}

// TemplateCanName reports whether some outbox row could make the topic
// template produce topic. A placeholder stands for any value a row may
// hold; the row check refuses empty ones, so each stands for at least one
// character.
func TemplateCanName(template, topic string) (bool, error) {
	t, err := parseTopicTemplate(template)
	if err != nil {
		return false, err
	}
	var pattern strings.Builder
	pattern.WriteString("^")
	for _, p := range t.parts {
		if p.field != nil {
			pattern.WriteString("(?s:.+)")
		} else {
			pattern.WriteString(regexp.QuoteMeta(p.literal))
		}
	}
	pattern.WriteString("$")
	return regexp.MustCompile(pattern.String()).MatchString(topic), nil
}
