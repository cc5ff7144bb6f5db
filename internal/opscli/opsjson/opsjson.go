// Package opsjson describes the JSON the operator commands print with
// --json, as scripts read it: the contract, written down independently of
// the types that produce it, so that a test decoding with these types fails
// when the output changes shape. Tests of the commands and of the roles use
// it.
package opsjson

import (
	"encoding/json"
	"slices"
	"testing"
	"time"
)

type (
	// Message is a message as ls, expedite, cancel and park print it.
	Message struct {
		ID          int64     `json:"id"`
		BusinessKey *string   `json:"business_key"`
		Seq         int64     `json:"seq"`
		TargetTopic *string   `json:"target_topic"`
		State       string    `json:"state"`
		NextRunAt   time.Time `json:"next_run_at"`
		Attempt     int       `json:"attempt"`
		Reason      *string   `json:"reason"`
	}
	// Change is what expedite, cancel and park print: how many changed, and which.
	Change struct {
		Expedited *int      `json:"expedited"`
		Cancelled *int      `json:"cancelled"`
		Parked    *int      `json:"parked"`
		Note      string    `json:"note"`
		Messages  []Message `json:"messages"`
	}
	// Status is what status prints.
	Status struct {
		Backlog []struct {
			TargetTopic *string `json:"target_topic"`
			State       string  `json:"state"`
			Messages    int     `json:"messages"`
			Due         int     `json:"due"`
		} `json:"backlog"`
		DueHeads        int     `json:"due_heads"`
		LatenessSeconds float64 `json:"lateness_seconds"`
		OldestDue       *struct {
			ID          int64  `json:"id"`
			BusinessKey string `json:"business_key"`
			TargetTopic string `json:"target_topic"`
		} `json:"oldest_due"`
		HeldKeys         int `json:"held_keys"`
		ParkedKeys       int `json:"parked_keys"`
		BackingOffKeys   int `json:"backing_off_keys"`
		RejectedLastHour int `json:"rejected_last_hour"`
		RejectedReasons  []struct {
			Reason   string `json:"reason"`
			Messages int    `json:"messages"`
		} `json:"rejected_reasons"`
	}
	// Story is what show prints: the row, its headers, lineage and history.
	Story struct {
		Message struct {
			Message
			ErrorClass     *string `json:"error_class"`
			IsHead         bool    `json:"is_head"`
			HoldsKey       bool    `json:"holds_key"`
			ParkHoldsKey   bool    `json:"park_holds_key"`
			ParkedAt       *string `json:"parked_at"`
			RedriveCount   int     `json:"redrive_count"`
			WaitingBehind  *int    `json:"waiting_behind"`
			PendingAhead   *int    `json:"pending_ahead"`
			KeyEncoding    *string `json:"key_encoding"`
			Key            *string `json:"key"`
			ValueBytes     *int    `json:"value_bytes"`
			ValueEncoding  *string `json:"value_encoding"`
			Value          *string `json:"value"`
			ValueTruncated bool    `json:"value_truncated"`
		} `json:"message"`
		Headers []struct {
			Position int    `json:"position"`
			Key      string `json:"key"`
			Encoding string `json:"encoding"`
			Value    string `json:"value"`
		} `json:"headers"`
		Lineage []struct {
			Relation string `json:"relation"`
			Message
		} `json:"lineage"`
		History []History `json:"history"`
	}
	// History is one event of a message's history.
	History struct {
		LineageID    int64   `json:"lineage_id"`
		MessageID    int64   `json:"message_id"`
		Event        string  `json:"event"`
		Attempt      int     `json:"attempt"`
		Reason       *string `json:"reason"`
		ErrorClass   *string `json:"error_class"`
		ErrorMessage *string `json:"error_message"`
	}
	// Held is a key held prints.
	Held struct {
		BusinessKey *string `json:"business_key"`
		Kind        string  `json:"kind"`
		HeadID      int64   `json:"head_id"`
		NextRunAt   *string `json:"next_run_at"`
		Reason      *string `json:"reason"`
		ParkedAt    *string `json:"parked_at"`
		Waiting     int     `json:"waiting"`
	}
	// Target is a per-target control as targets prints it.
	Target struct {
		TargetTopic string   `json:"target_topic"`
		Paused      bool     `json:"paused"`
		RateLimit   *float64 `json:"rate_limit"`
		Weight      int      `json:"weight"`
		Note        *string  `json:"note"`
		UpdatedAt   string   `json:"updated_at"`
	}
	// TargetChange is what pause, resume, limit and weight print.
	TargetChange struct {
		Changed bool   `json:"changed"`
		Target  Target `json:"target"`
		Note    string `json:"note"`
	}
	// Inflight is a key in flight for a consumer group as inflight and
	// release print it.
	Inflight struct {
		GroupID      string  `json:"group_id"`
		BusinessKey  string  `json:"business_key"`
		TargetTopic  string  `json:"target_topic"`
		Partition    int32   `json:"partition"`
		RecordOffset int64   `json:"record_offset"`
		MessageID    int64   `json:"message_id"`
		Seq          int64   `json:"seq"`
		PublishedAt  string  `json:"published_at"`
		AgeSeconds   float64 `json:"age_seconds"`
	}
	// Release is what release prints: the keys released, or with --dry-run
	// those that match.
	Release struct {
		Group    string     `json:"group"`
		Key      *string    `json:"key"`
		DryRun   bool       `json:"dry_run"`
		Matched  int        `json:"matched"`
		Released int        `json:"released"`
		Keys     []Inflight `json:"keys"`
	}
)

// Decode parses out as T, failing the test if it is not JSON.
func Decode[T any](t testing.TB, out string) T {
	t.Helper()
	var v T
	if err := json.Unmarshal([]byte(out), &v); err != nil {
		t.Fatalf("output is not the JSON expected: %v\n%s", err, out)
	}
	return v
}

// IDs returns the ids of ms, in order.
func IDs(ms []Message) []int64 {
	var out []int64
	for _, m := range ms {
		out = append(out, m.ID)
	}
	return out
}

// SameIDs fails the test unless got is want, in order; what names the list.
func SameIDs(t testing.TB, what string, got []int64, want ...int64) {
	t.Helper()
	if !slices.Equal(got, want) {
		t.Errorf("%s: ids %v, want %v", what, got, want)
	}
}
