package config

import (
	"errors"
	"strings"
	"testing"
)

// fuzzedVars are the variables FuzzConfig sets from its arguments, in
// argument order.
var fuzzedVars = []string{
	"RETRY_POLICIES", "NON_RETRIABLE_ERRORS", "TARGET_TOPICS", "SIGNING_KEYS", "KAFKA_SASL_PASSWORD",
	"MAX_DELAY", "LEASE_DURATION", "KAFKA_TIMEOUT", "HISTORY_RETENTION", "INGEST_BATCH_SIZE", "DEFER_TOPIC",
}

// FuzzConfig feeds arbitrary values for a handful of variables to
// Load. Whatever they hold: it does not panic; every problem it reports
// names a variable; and no error quotes a secret (the SASL password, or a key
// of SIGNING_KEYS).
func FuzzConfig(f *testing.F) {
	key := strings.Repeat("ab", 32)
	// Valid, so that the fuzzer starts from inputs that get past parsing.
	f.Add("payments.*: ladder 30s,5m,30m dlq {target}.dlq; *: exponential 1s x2 cap 1h max 10",
		"*JsonParseException,com.acme.Validation*", "orders.*,payments.retry", "billing="+key, "hunter2-hunter2",
		"720h", "90s", "5s", "720h", "1000", "scheduler.defer")
	// Each of them wrong.
	f.Add("payments.*: ladder 30s,5m,30m,1000h", "[", "orders.[", "billing="+strings.Repeat("zz", 32)+",orders="+key,
		"p4ssw0rd-p4ssw0rd", "-1s", "1s", "2m", "-5h", "0", "a/b")
	f.Add("*: exponential 0s x0", "a,,b", ",", "orders", "", "1.5", "forever", "99ms", "x", "1e9", "")
	f.Add("x: ladder", "", "*", "=,="+key+"="+key, "secret\x00secret", "9223372036854775807ns", "", "", "0", "-1", strings.Repeat("t", 250))
	f.Fuzz(func(t *testing.T, policies, nonRetriable, targets, signing, password, maxDelay, lease, timeout, retention, batch, deferTopic string) {
		values := []string{policies, nonRetriable, targets, signing, password, maxDelay, lease, timeout, retention, batch, deferTopic}
		environ := func(password string) []string {
			// PLAIN with a user, so that the password reaches the Kafka
			// client's configuration.
			env := []string{"KAFKA_SASL_MECHANISM=PLAIN", "KAFKA_SASL_USER=fuzz"}
			for i, name := range fuzzedVars {
				v := values[i]
				if name == "KAFKA_SASL_PASSWORD" {
					v = password
				}
				env = append(env, name+"="+v)
			}
			return env
		}
		_, err := Load(environ(password))
		if err == nil {
			return
		}
		text := err.Error()

		// Every problem starts with the name of the variable it is about
		// (a fuzzed value quoted later in the text must not pass for one).
		// Any config variable counts, since a fuzzed value can make another
		// variable's check fail (KAFKA_TIMEOUT and LEASE_DURATION).
		for _, leaf := range leafErrors(err) {
			named := false
			for _, v := range Vars() {
				named = named || strings.HasPrefix(leaf.Error(), v.Name)
			}
			if !named {
				t.Errorf("error names no variable: %q\nin: %s", leaf, text)
			}
		}

		// The password: it may legitimately occur in the text only through
		// some other value or fixed wording, so the same configuration with
		// another password must then show it too.
		if len(password) >= 4 && strings.Contains(text, password) {
			_, other := Load(environ("other-password"))
			if other == nil || !strings.Contains(other.Error(), password) {
				t.Errorf("KAFKA_SASL_PASSWORD %q appears in the error:\n%s", password, text)
			}
		}

		// The keys of SIGNING_KEYS: key-like text (16+ hex digits) must not
		// be quoted, unless it is also a source name or another variable's
		// value, which errors do quote.
		var public []string
		for i, name := range fuzzedVars {
			if name != "SIGNING_KEYS" && name != "KAFKA_SASL_PASSWORD" {
				public = append(public, values[i])
			}
		}
		for entry := range strings.SplitSeq(signing, ",") {
			src, k, ok := strings.Cut(entry, "=")
			if !ok {
				continue
			}
			public = append(public, src)
			for part := range strings.SplitSeq(k, "=") {
				part = strings.TrimSpace(part)
				if len(part) < 16 || strings.Trim(part, "0123456789abcdefABCDEF") != "" {
					continue
				}
				if strings.Contains(text, part) && !containedIn(part, public) {
					t.Errorf("a key of SIGNING_KEYS (%q) appears in the error:\n%s", part, text)
				}
			}
		}
	})
}

// leafErrors flattens errors.Join trees into the errors they join.
func leafErrors(err error) []error {
	j, ok := err.(interface{ Unwrap() []error })
	if !ok {
		return []error{err}
	}
	var out []error
	for _, e := range j.Unwrap() {
		out = append(out, leafErrors(e)...)
	}
	return out
}

func containedIn(s string, in []string) bool {
	for _, v := range in {
		if strings.Contains(v, s) {
			return true
		}
	}
	return false
}

// leafErrors must see every joined error, or FuzzConfig would check less
// than it claims.
func TestLeafErrors(t *testing.T) {
	joined := errors.Join(errors.New("MAX_DELAY bad"), errors.Join(errors.New("no name"), errors.New("LOG_LEVEL bad")))
	leaves := leafErrors(joined)
	if len(leaves) != 3 || leaves[1].Error() != "no name" {
		t.Fatalf("leafErrors = %q, want the 3 joined errors", leaves)
	}
}
