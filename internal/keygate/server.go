// Package keygate is the scheduler's side of the consumers' key gate: the
// key-state query, POST /v1/key-state on HTTP_ADDR (wire format in
// internal/keystate). It authenticates a request with its source's signing
// key, waits until ingest has stored everything produced to the defer topic
// before the question (read-your-writes), and answers from the SQL function
// deferred_key_state (docs/design.md section 23.2).
package keygate

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"mime"
	"net/http"
	"slices"
	"strconv"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/IBM/sarama"

	"github.com/deferq/scheduler/internal/defer/protocol"
	"github.com/deferq/scheduler/internal/keystate"
	"github.com/deferq/scheduler/internal/metrics"
	"github.com/deferq/scheduler/sql/queries"
)

// DefaultWait is how long the server waits for ingest to catch up with the
// defer topic when a request does not say (wait_ms 0): long enough to ride
// out a batch linger and a commit, short enough that a consumer stalled
// behind it notices.
const DefaultWait = 2 * time.Second

// The wait polls the stored ingest positions, first after pollFirst, then
// doubling up to pollMax: ingest usually catches up within a batch linger
// (20 ms), and a lagging one should not cost a query per millisecond per
// waiting request.
const (
	pollFirst = 5 * time.Millisecond
	pollMax   = 20 * time.Millisecond
)

// queryGrace bounds the statements that run after the wait: the last poll
// of the positions and the key-state statement itself. The client's own
// timeout is its wait plus 5 s, so an answer must come within that.
const queryGrace = 3 * time.Second

// Offsets tells the server how far the partitions of the defer topic
// reach, to know what ingest must have stored before an answer can be
// trusted. KafkaOffsets asks the brokers; tests give fixed answers.
type Offsets interface {
	// HighWaterMarks returns the high-water mark (the offset the next
	// record will take) of every partition of topic, as the brokers know
	// them now: every record acknowledged to a producer is below it.
	HighWaterMarks(topic string) (map[int32]int64, error)
	// LogStart returns the partition's log start offset: the oldest record
	// Kafka still has.
	LogStart(topic string, partition int32) (int64, error)
}

// Config is what a Server needs.
type Config struct {
	// DB runs the statements: the scheduler's pool.
	DB queries.DBTX
	// Offsets reads the defer topic's high-water marks. Nil: the server
	// answers 503 "kafka: connecting" until SetOffsets gives it one, since
	// the scheduler serves HTTP before Kafka answers.
	Offsets Offsets
	// Topic is the defer topic, DEFER_TOPIC.
	Topic string
	// Keys are the signing keys of sources, SIGNING_KEYS: with any, every
	// request must be signed by one of them (see keystate.Sign). Without, the query
	// is open to whoever reaches HTTP_ADDR, as /metrics is; it discloses
	// only whether keys are blocked, and changes nothing.
	Keys map[string][]byte
	// Wait is the wait of a request that gives none (0: DefaultWait).
	Wait time.Duration
	// Metrics counts answers; nil counts nothing.
	Metrics *metrics.Metrics
	// Logger gets refusals and unsure answers, never a request's body.
	Logger *slog.Logger
	// Now is the clock request timestamps are checked against (nil:
	// time.Now).
	Now func() time.Time
}

// Server answers the key-state query (POST keystate.Path). Every answer it gives
// with 200 reflects every record produced to the defer topic before the
// request came in; when it cannot vouch for that in time, it answers 503
// and the client counts the keys as blocked. It only reads: no request
// changes anything, whatever it holds.
type Server struct {
	cfg     Config
	keys    map[string][]byte
	offsets atomic.Pointer[Offsets]
}

// NewServer returns a Server; it copies cfg.Keys.
func NewServer(cfg Config) *Server {
	if cfg.Wait <= 0 {
		cfg.Wait = DefaultWait
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	s := &Server{cfg: cfg, keys: map[string][]byte{}}
	for src, key := range cfg.Keys {
		if len(key) > 0 {
			s.keys[src] = bytes.Clone(key)
		}
	}
	if cfg.Offsets != nil {
		s.SetOffsets(cfg.Offsets)
	}
	return s
}

// SetOffsets gives the server its view of Kafka once the scheduler has
// connected. It may be called while requests are served.
func (s *Server) SetOffsets(o Offsets) { s.offsets.Store(&o) }

// ServeHTTP answers one key-state request. In order: 405 unless POST, 415
// unless JSON, 413 over keystate.MaxBodyBytes, 401 unless signed when signing keys
// are configured, 400 for a request that is not valid; then 503 when
// ingest has not stored the defer topic up to the high-water marks within
// the wait, or Kafka or the database fails; else 200 with one keystate.State per
// key given, in their order (a key given twice is answered twice: the
// client sends each once, and answering in the order given keeps its check
// of the answer simple).
//
// The wait (wait_ms, else Config.Wait) covers reading the high-water marks
// and waiting for ingest; the key-state statement after it has queryGrace
// of its own, which keeps the whole answer within the client's timeout.
func (s *Server) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	start := time.Now()
	body, ok := s.readBody(w, r, "key-state query", keystate.Path)
	if !ok {
		return
	}
	req, why := parseRequest(body)
	if why != "" {
		s.refuse(w, r, http.StatusBadRequest, why)
		return
	}
	wait := s.cfg.Wait
	if req.WaitMillis > 0 {
		wait = time.Duration(req.WaitMillis) * time.Millisecond
	}
	why = ""
	if req.Wait == keystate.WaitPositions {
		if len(req.Positions) > 0 {
			deadline := time.Now().Add(wait)
			why = s.waitStored(r.Context(), wait, deadline, req.Positions, nil)
		}
	} else {
		why = s.catchUp(r.Context(), wait)
	}
	if why != "" {
		s.unsure(w, r, req.Group, why)
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), queryGrace)
	defer cancel()
	// Read before the keys' state, which then covers every record below
	// these offsets: a client keeps its own deferrals blocked until Stored
	// covers them.
	storedRows, err := queries.IngestStored(ctx, s.cfg.DB, queries.IngestStoredParams{Topic: s.cfg.Topic})
	if err != nil {
		s.unsure(w, r, req.Group, "database: reading the ingest positions of "+s.cfg.Topic+": "+err.Error())
		return
	}
	stored := make(map[int32]int64, len(storedRows))
	for _, row := range storedRows {
		stored[row.Partition] = row.NextOffset
	}
	// Each distinct key is asked once; duplicates share its answer.
	rows, err := queries.KeyState(ctx, s.cfg.DB, queries.KeyStateParams{Group: req.Group, Keys: distinct(req.Keys)})
	if err != nil {
		s.unsure(w, r, req.Group, "database: reading the keys' state: "+err.Error())
		return
	}
	byKey := make(map[string]queries.KeyStateRow, len(rows))
	for _, row := range rows {
		byKey[row.BusinessKey] = row
	}
	resp := keystate.Response{Keys: make([]keystate.State, len(req.Keys)), Stored: stored}
	blocked := 0
	for i, k := range req.Keys {
		row, ok := byKey[k]
		if !ok {
			s.unsure(w, r, req.Group, fmt.Sprintf("database: deferred_key_state gave no row for keys[%d]", i))
			return
		}
		st := keystate.State{Key: k, Blocked: row.Blocked}
		if row.Blocked {
			blocked++
			st.Reason = deref(row.Reason)
			st.HeadSeq, st.HeadID = deref(row.HeadSeq), deref(row.HeadID)
		}
		resp.Keys[i] = st
	}
	writeJSON(w, http.StatusOK, resp)
	s.cfg.Metrics.KeyStateAnswered(time.Since(start), blocked, len(req.Keys)-blocked)
}

// readBody reads a request for the what at path up to its authentication, and refuses
// it when it fails; ok says it may be parsed. In order: 405 unless POST,
// 415 unless JSON, 413 over keystate.MaxBodyBytes, 401 unless signed when
// signing keys are configured.
func (s *Server) readBody(w http.ResponseWriter, r *http.Request, what, path string) (body []byte, ok bool) {
	if r.Method != http.MethodPost {
		w.Header().Set("Allow", http.MethodPost)
		s.refuse(w, r, http.StatusMethodNotAllowed, fmt.Sprintf("method %s is not allowed: the %s is POST %s with a JSON body", r.Method, what, path))
		return nil, false
	}
	if mt, _, err := mime.ParseMediaType(r.Header.Get("Content-Type")); err != nil || mt != "application/json" {
		s.refuse(w, r, http.StatusUnsupportedMediaType, fmt.Sprintf("Content-Type %q is not application/json", r.Header.Get("Content-Type")))
		return nil, false
	}
	if r.ContentLength > keystate.MaxBodyBytes {
		s.refuse(w, r, http.StatusRequestEntityTooLarge, fmt.Sprintf("the body is %d bytes, at most %d", r.ContentLength, keystate.MaxBodyBytes))
		return nil, false
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, keystate.MaxBodyBytes))
	if err != nil {
		if _, ok := errors.AsType[*http.MaxBytesError](err); ok {
			s.refuse(w, r, http.StatusRequestEntityTooLarge, fmt.Sprintf("the body is over %d bytes", keystate.MaxBodyBytes))
		} else {
			s.refuse(w, r, http.StatusBadRequest, "reading the body: "+err.Error())
		}
		return nil, false
	}
	// Authentication comes before the body is parsed, so that who may not
	// ask learns nothing from the validation either.
	if why := s.authenticate(r.Header, body); why != "" {
		s.refuse(w, r, http.StatusUnauthorized, why)
		return nil, false
	}
	return body, true
}

// authenticate checks a request's signature when signing keys are
// configured, and returns what is wrong with it, "" when nothing is.
func (s *Server) authenticate(h http.Header, body []byte) string {
	if len(s.keys) == 0 {
		return ""
	}
	src := h.Get(keystate.HeaderSource)
	if src == "" {
		return keystate.HeaderSource + " is missing: this scheduler answers signed key-state requests only (SIGNING_KEYS)"
	}
	key, ok := s.keys[src]
	if !ok {
		if !protocol.ValidSource(src) {
			return fmt.Sprintf("%s is not a source name (1 to %d of [A-Za-z0-9._-])", keystate.HeaderSource, protocol.MaxSourceBytes)
		}
		return fmt.Sprintf("%s %q has no signing key here (SIGNING_KEYS)", keystate.HeaderSource, src)
	}
	text := h.Get(keystate.HeaderTimestamp)
	if text == "" {
		return keystate.HeaderTimestamp + " is missing"
	}
	ts, err := strconv.ParseInt(text, 10, 64)
	if err != nil {
		return keystate.HeaderTimestamp + " is not Unix seconds"
	}
	// Compared this way round so that no timestamp overflows.
	if now := s.cfg.Now().Unix(); ts < now-keystate.MaxClockSkew || ts > now+keystate.MaxClockSkew {
		return fmt.Sprintf("%s %d is %s the server's clock (%d); at most %ds either way: check the clocks, or the request is a replay",
			keystate.HeaderTimestamp, ts, skew(ts, now), now, keystate.MaxClockSkew)
	}
	sig := h.Get(keystate.HeaderSignature)
	if sig == "" {
		return keystate.HeaderSignature + " is missing"
	}
	if !keystate.Verify(key, ts, body, sig) {
		return fmt.Sprintf("%s does not verify under the key of source %q: signed with another key, or over another body or timestamp", keystate.HeaderSignature, src)
	}
	return ""
}

// skew says how far ts is from now, in words.
func skew(ts, now int64) string {
	if ts < now {
		return fmt.Sprintf("%ds behind", uint64(now)-uint64(ts))
	}
	return fmt.Sprintf("%ds ahead of", uint64(ts)-uint64(now))
}

// parseRequest decodes and validates a request body, and returns what is
// wrong with it, naming the field (and the key's index), "" when nothing
// is.
func parseRequest(body []byte) (keystate.Request, string) {
	var req keystate.Request
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&req); err != nil {
		return req, "the body is not a key-state request: " + err.Error()
	}
	if _, err := dec.Token(); err != io.EOF {
		return req, "the body holds more than one JSON value"
	}
	groupBad, keysBad := invalidText(body)
	if why := checkGroup(req.Group); why != "" {
		return req, why
	}
	if groupBad {
		return req, "group is not valid UTF-8"
	}
	if len(req.Keys) == 0 {
		return req, "keys is empty: ask about at least one business key"
	}
	if why := checkKeys(req.Keys, keysBad); why != "" {
		return req, why
	}
	if req.WaitMillis < 0 || req.WaitMillis > keystate.MaxWaitMillis {
		return req, fmt.Sprintf("wait_ms is %d; want 0 (the server's default) to %d", req.WaitMillis, keystate.MaxWaitMillis)
	}
	switch req.Wait {
	case "", keystate.WaitAll:
		if len(req.Positions) > 0 {
			return req, fmt.Sprintf("positions are given with wait %q; they go with wait %q", req.Wait, keystate.WaitPositions)
		}
	case keystate.WaitPositions:
		if len(req.Positions) > keystate.MaxPositions {
			return req, fmt.Sprintf("positions holds %d partitions, at most %d", len(req.Positions), keystate.MaxPositions)
		}
		for _, part := range slices.Sorted(maps.Keys(req.Positions)) {
			if off := req.Positions[part]; part < 0 || off < 0 {
				return req, fmt.Sprintf("positions[%d] is %d: want a partition and an offset of 0 or more", part, off)
			}
		}
	default:
		return req, fmt.Sprintf("wait is %q; want %q (the default) or %q", req.Wait, keystate.WaitAll, keystate.WaitPositions)
	}
	return req, ""
}

// invalidText reports which of the request's strings are not valid UTF-8
// as sent. encoding/json does not refuse them: it replaces invalid bytes,
// and escaped surrogates that do not pair up, with U+FFFD, so the key
// answered would not be the key asked about. Most bodies are valid UTF-8
// without a surrogate escape, and skip the second decode.
func invalidText(body []byte) (group bool, keys map[int]bool) {
	if utf8.Valid(body) && !bytes.Contains(body, []byte(`\ud`)) && !bytes.Contains(body, []byte(`\uD`)) {
		return false, nil
	}
	var raw struct {
		Group json.RawMessage   `json:"group"`
		Keys  []json.RawMessage `json:"keys"`
	}
	if json.Unmarshal(body, &raw) != nil {
		return false, nil // the strict decode accepted it; cannot happen
	}
	keys = map[int]bool{}
	for i, k := range raw.Keys {
		if !validText(k) {
			keys[i] = true
		}
	}
	return raw.Group != nil && !validText(raw.Group), keys
}

// validText reports whether a JSON string token decodes to exactly what it
// says: valid UTF-8, and every \u escape of a surrogate one of a pair.
func validText(tok []byte) bool {
	if !utf8.Valid(tok) {
		return false
	}
	for i := 0; i < len(tok); i++ {
		if tok[i] != '\\' {
			continue
		}
		i++ // the escaped character; the loop steps past it
		if i >= len(tok) || tok[i] != 'u' {
			continue
		}
		r, ok := hex4(tok[i+1:])
		if !ok {
			continue
		}
		i += 4
		switch {
		case 0xDC00 <= r && r <= 0xDFFF:
			return false // a low surrogate with no high one before it
		case 0xD800 <= r && r <= 0xDBFF:
			if i+6 >= len(tok) || tok[i+1] != '\\' || tok[i+2] != 'u' {
				return false
			}
			if lo, ok := hex4(tok[i+3:]); !ok || lo < 0xDC00 || lo > 0xDFFF {
				return false
			}
			i += 6
		}
	}
	return true
}

// hex4 decodes the four hex digits b starts with.
func hex4(b []byte) (rune, bool) {
	if len(b) < 4 {
		return 0, false
	}
	v, err := strconv.ParseUint(string(b[:4]), 16, 16)
	return rune(v), err == nil
}

// catchUp waits until ingest has stored every partition of the defer topic
// up to the high-water mark it has when the wait begins, for at most wait.
// It returns why it could not vouch for that, "" once it can.
//
// A partition is caught up when its stored ingest position (ingest_offset,
// the next offset to read) is at or past its high-water mark; one with no
// position when nothing can be read from it (its high-water mark is its
// log start). The marks are read once, not followed: what is produced
// while the request waits is after the question, and following it could
// wait for ever on a busy topic. Each poll that finds ingest behind asks
// every process's ingest to write what it holds (queries.IngestFlush), so
// that records lingering for INGEST_FUTURE_LINGER do not make the answer
// wait that long.
func (s *Server) catchUp(ctx context.Context, wait time.Duration) string {
	p := s.offsets.Load()
	if p == nil {
		return "kafka: connecting; the high-water marks of " + s.cfg.Topic + " cannot be read yet"
	}
	offsets := *p
	topic := s.cfg.Topic
	deadline := time.Now().Add(wait)
	kafkaCtx, cancel := context.WithDeadline(ctx, deadline)
	defer cancel()
	marks, err := bounded(kafkaCtx, func() (map[int32]int64, error) { return offsets.HighWaterMarks(topic) })
	if err != nil {
		return "kafka: reading the high-water marks of " + topic + ": " + s.timeout(err, wait)
	}
	return s.waitStored(ctx, wait, deadline, marks, func(part int32) (int64, error) {
		return bounded(kafkaCtx, func() (int64, error) { return offsets.LogStart(topic, part) })
	})
}

// waitStored waits until ingest has stored each partition of the defer
// topic up to marks (the next offset it must read at least), polling until
// deadline, the end of a wait of wait. It returns why it could not vouch
// for that, "" once it can. logStart, when marks are high-water marks,
// reads a partition's log start: a partition with no stored position whose
// log starts at its mark holds nothing to read. nil: marks are the
// positions a request waits for. Each poll that finds ingest behind asks
// every process's ingest to write what it holds.
func (s *Server) waitStored(ctx context.Context, wait time.Duration, deadline time.Time, marks map[int32]int64,
	logStart func(part int32) (int64, error)) string {
	topic := s.cfg.Topic
	parts := slices.Sorted(maps.Keys(marks))
	starts := map[int32]int64{}
	// The polls may outlive the wait by queryGrace: the last one runs at
	// the deadline.
	dbCtx, dbCancel := context.WithDeadline(ctx, deadline.Add(queryGrace))
	defer dbCancel()
	delay := pollFirst
	for {
		rows, err := queries.IngestPositions(dbCtx, s.cfg.DB, queries.IngestPositionsParams{Topic: topic, Partitions: parts})
		if err != nil {
			return "database: reading the ingest positions of " + topic + ": " + err.Error()
		}
		stored := make(map[int32]int64, len(rows))
		for _, row := range rows {
			stored[row.Partition] = row.NextOffset
		}
		behind, first := 0, ""
		for _, part := range parts {
			mark := marks[part]
			next, has := stored[part]
			if has && next >= mark {
				continue
			}
			var start int64
			if !has {
				if mark == 0 {
					continue // an empty partition
				}
				if logStart != nil {
					var known bool
					if start, known = starts[part]; !known {
						if start, err = logStart(part); err != nil {
							return fmt.Sprintf("kafka: reading the log start of %s/%d: %s", topic, part, s.timeout(err, wait))
						}
						starts[part] = start
					}
					if start >= mark {
						continue // retention deleted all it held: nothing to read
					}
				}
			}
			behind++
			switch {
			case first != "":
			case has && logStart == nil:
				first = fmt.Sprintf("ingest has stored %s/%d up to offset %d, the request waits for %d", topic, part, next, mark)
			case has:
				first = fmt.Sprintf("ingest has stored %s/%d up to offset %d, the high-water mark is %d", topic, part, next, mark)
			case logStart == nil:
				first = fmt.Sprintf("ingest has stored nothing of %s/%d, the request waits for %d", topic, part, mark)
			default:
				first = fmt.Sprintf("ingest has stored nothing of %s/%d, which holds offsets %d to %d (high-water mark %d)", topic, part, start, mark-1, mark)
			}
		}
		if behind == 0 {
			return ""
		}
		// Records that fall due later may be lingering in a batch
		// (INGEST_FUTURE_LINGER): ask every process to write them now
		// rather than wait them out. At every poll that finds ingest
		// behind, not once: a record still on its way from the broker, or
		// read by a claim that started since, would linger after the
		// first. A failure only makes the wait longer.
		if err := queries.IngestFlush(dbCtx, s.cfg.DB); err != nil {
			s.cfg.Logger.Debug("cannot ask ingest to write what it holds", "error", err)
		}
		left := time.Until(deadline)
		if left <= 0 {
			switch behind {
			case 1:
			case 2:
				first += " (and 1 more partition behind)"
			default:
				first += fmt.Sprintf(" (and %d more partitions behind)", behind-1)
			}
			return fmt.Sprintf("%s; not caught up within %v", first, wait)
		}
		t := time.NewTimer(min(delay, left))
		select {
		case <-ctx.Done():
			t.Stop()
			return "the request ended while waiting: " + ctx.Err().Error()
		case <-t.C:
		}
		delay = min(2*delay, pollMax)
	}
}

// CaughtUp waits, at most wait, until ingest has stored every partition of
// the defer topic up to the high-water mark it has now, as a key-state
// request does before it answers; the error says what is behind. The
// in-flight release calls it before it lets keys go (internal/inflight).
func (s *Server) CaughtUp(ctx context.Context, wait time.Duration) error {
	if why := s.catchUp(ctx, wait); why != "" {
		return errors.New(why)
	}
	return nil
}

// timeout words an error of a call bounded by the wait.
func (s *Server) timeout(err error, wait time.Duration) string {
	if errors.Is(err, context.DeadlineExceeded) {
		return fmt.Sprintf("no answer within %v", wait)
	}
	return err.Error()
}

// bounded runs f, which cannot be cancelled (sarama's calls are bounded by
// KAFKA_TIMEOUT, not by a context), and returns its result, or ctx's error
// when ctx ends first; f then finishes on its own.
func bounded[T any](ctx context.Context, f func() (T, error)) (T, error) {
	type result struct {
		v   T
		err error
	}
	done := make(chan result, 1)
	go func() {
		v, err := f()
		done <- result{v, err}
	}()
	select {
	case r := <-done:
		return r.v, r.err
	case <-ctx.Done():
		var zero T
		return zero, ctx.Err()
	}
}

// refuse answers a request that is not valid or not allowed.
func (s *Server) refuse(w http.ResponseWriter, r *http.Request, status int, why string) {
	writeJSON(w, status, keystate.ErrorResponse{Error: why})
	if q := setQuery(r); q != "" {
		s.cfg.Metrics.KeySetRequest(q, "refused")
	} else {
		s.cfg.Metrics.KeyStateRefused()
	}
	// A signature that does not verify is worth seeing without debug
	// logging: a client with the wrong key, or someone probing.
	level := slog.LevelDebug
	if status == http.StatusUnauthorized {
		level = slog.LevelInfo
	}
	s.cfg.Logger.Log(r.Context(), level, "key-state request refused", "status", status, "error", why, "remote", r.RemoteAddr)
}

// unsure answers a valid request the server cannot vouch for an answer
// to: the client counts its keys as blocked.
func (s *Server) unsure(w http.ResponseWriter, r *http.Request, group, why string) {
	writeJSON(w, http.StatusServiceUnavailable, keystate.ErrorResponse{Error: why})
	if q := setQuery(r); q != "" {
		s.cfg.Metrics.KeySetRequest(q, "unsure")
	} else {
		s.cfg.Metrics.KeyStateUnsure()
	}
	s.cfg.Logger.Info("key-state request unsure", "group", group, "error", why, "remote", r.RemoteAddr)
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	// An answer is true when given and may be false a millisecond later.
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v)
}

// distinct returns keys without repeats, in first-seen order.
func distinct(keys []string) []string {
	seen := make(map[string]bool, len(keys))
	out := make([]string, 0, len(keys))
	for _, k := range keys {
		if !seen[k] {
			seen[k] = true
			out = append(out, k)
		}
	}
	return out
}

func deref[T any](p *T) T {
	if p == nil {
		var zero T
		return zero
	}
	return *p
}

// KafkaOffsets is Offsets over a sarama client. Its client should be its
// own, with KAFKA_TIMEOUT as read timeout: ingest's consumer waits far
// longer (a rebalance), and a request must not.
type KafkaOffsets struct {
	Client sarama.Client
}

// HighWaterMarks refreshes the topic's metadata, so that a partition added
// since is waited for too (its producer knew of it to produce there), and
// asks each partition leader for its partitions' high-water marks in one
// request. A partition whose leader moved is asked again through
// Client.GetOffset, which refreshes the metadata and retries once.
//
// The marks are read uncommitted, as ingest reads: producers to the defer
// topic are not transactional.
func (k KafkaOffsets) HighWaterMarks(topic string) (map[int32]int64, error) {
	if err := k.Client.RefreshMetadata(topic); err != nil {
		return nil, fmt.Errorf("metadata of %s: %w", topic, err)
	}
	return k.Marks(topic)
}

// Marks is HighWaterMarks on the metadata the client has, without
// refreshing it first: for a caller that polls a topic whose partitions do
// not change (the bench counts its targets this way every 10 ms).
func (k KafkaOffsets) Marks(topic string) (map[int32]int64, error) {
	parts, err := k.Client.Partitions(topic)
	if err != nil {
		return nil, fmt.Errorf("partitions of %s: %w", topic, err)
	}
	if len(parts) == 0 {
		return nil, fmt.Errorf("%s has no partitions", topic)
	}
	marks := make(map[int32]int64, len(parts))
	byLeader := map[*sarama.Broker][]int32{}
	var again []int32
	for _, p := range parts {
		b, err := k.Client.Leader(topic, p)
		if err != nil {
			again = append(again, p)
			continue
		}
		byLeader[b] = append(byLeader[b], p)
	}
	for b, ps := range byLeader {
		req := sarama.NewOffsetRequest(k.Client.Config().Version)
		for _, p := range ps {
			req.AddBlock(topic, p, sarama.OffsetNewest, 1)
		}
		resp, err := b.GetAvailableOffsets(req)
		for _, p := range ps {
			var blk *sarama.OffsetResponseBlock
			if err == nil {
				blk = resp.GetBlock(topic, p)
			}
			if blk == nil || !errors.Is(blk.Err, sarama.ErrNoError) || len(blk.Offsets) != 1 {
				again = append(again, p)
				continue
			}
			marks[p] = blk.Offsets[0]
		}
	}
	for _, p := range again {
		if marks[p], err = k.Client.GetOffset(topic, p, sarama.OffsetNewest); err != nil {
			return nil, fmt.Errorf("high-water mark of %s/%d: %w", topic, p, err)
		}
	}
	return marks, nil
}

// LogStart asks the partition's leader for its log start offset.
func (k KafkaOffsets) LogStart(topic string, partition int32) (int64, error) {
	start, err := k.Client.GetOffset(topic, partition, sarama.OffsetOldest)
	if err != nil {
		return 0, fmt.Errorf("log start of %s/%d: %w", topic, partition, err)
	}
	return start, nil
}

// HighWaterMarks returns the defer topic's high-water marks through the
// server's view of Kafka, for others that show how far ingest is behind
// (the console). Before the scheduler has connected to Kafka it says so.
func (s *Server) HighWaterMarks() (map[int32]int64, error) {
	p := s.offsets.Load()
	if p == nil {
		return nil, errors.New("not connected to Kafka yet")
	}
	return (*p).HighWaterMarks(s.cfg.Topic)
}
