// Package gate is the part of the defer scheduler's client library that
// does not depend on a Kafka client: the records it reads and writes, how a
// failed record is deferred (its headers, its signature, its partition of
// the defer topic), the key-state question to the scheduler, and the batch
// gating that keeps a business key's order end to end. The adapters build
// on it: deferclient for sarama (github.com/IBM/sarama) and
// deferclient/deferkgo for franz-go (github.com/twmb/franz-go); each
// implements Producer and Consumer over its Kafka client, so that neither
// client's users import the other client.
//
// Applications use an adapter; this package is for the types the adapters
// share (Deferral, KeyState, Stats, the Reason constants) and for writing
// an adapter for another Kafka client. See the README's "Key order end to
// end" and docs/design.md section 23.
package gate

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/deferq/scheduler/internal/defer/protocol"
)

// DefaultDeferTopic is the scheduler's input topic unless it is configured
// otherwise (DEFER_TOPIC).
const DefaultDeferTopic = "scheduler.defer"

// Config configures a Gate. The adapters' configurations carry the same
// fields.
type Config struct {
	// DeferTopic is the scheduler's input topic; "" means
	// DefaultDeferTopic.
	DeferTopic string
	// Group is the consumer group the service consumes as. Deferred
	// records name it (defer.group), and the scheduler answers key-state
	// queries for it. Required for HandleBatch and KeyStates.
	Group string
	// SchedulerURL is the scheduler's HTTP address (its HTTP_ADDR), or
	// several separated by commas (the replicas, without a load
	// balancer): a question one does not answer (no connection, or a 5xx)
	// goes to the next. Required for HandleBatch and KeyStates.
	SchedulerURL string
	// Source names this service (1 to 128 of [A-Za-z0-9._-]); with
	// SourceKey, deferred records are signed and key-state queries
	// authenticated with it, as the scheduler's SIGNING_KEYS expect.
	Source    string
	SourceKey []byte
	// HTTPClient sends the key-state queries; nil means a client with a
	// timeout of KeyStateWait plus 5 seconds.
	HTTPClient *http.Client
	// KeyStateWait bounds how long the scheduler may wait for its ingest
	// to catch up with the defer topic before it answers (0: 2 seconds).
	// Past it, the answer is that it does not know, and the keys count as
	// blocked.
	KeyStateWait time.Duration
}

// Position is where the broker put a record: its partition and offset.
type Position struct {
	Partition int32
	Offset    int64
}

// Producer writes deferrals to the defer topic. An adapter implements it
// with its Kafka client's producer, which must wait for every in-sync
// replica (acks=all), must not duplicate or reorder a record when it
// retries (idempotent), and must write each record to the partition Out
// names.
type Producer interface {
	// Partitions returns how many partitions topic has.
	Partitions(ctx context.Context, topic string) (int32, error)
	// Produce writes outs, in order, and returns once the broker
	// acknowledged all of them, with where each went, in the order of
	// outs. On error some may have been written.
	Produce(ctx context.Context, outs []Out) ([]Position, error)
}

// Gate defers records and asks the scheduler which business keys are
// blocked, and gates batches of consumed records with the answer. It is
// safe for concurrent use.
type Gate struct {
	cfg  Config
	p    Producer
	urls []string
	http *http.Client
	// next rotates the scheduler URL a query starts with.
	next atomic.Uint32
	// waitAllOnly: a scheduler refused a question that waits for less
	// than the whole topic (a release before the wait field); every
	// question waits for all from then on.
	waitAllOnly atomic.Bool

	// pending remembers the keys this process deferred until the
	// scheduler confirms them (see KeyStates).
	pendingMu sync.Mutex
	pending   map[string]localDeferral

	// set is the group's blocked keys, loaded at each assignment and
	// followed (keyset.go).
	set keySet

	statsMu sync.Mutex
	stats   Stats
}

// localDeferral is a deferral of this process the scheduler may not have
// stored yet.
type localDeferral struct {
	at time.Time
	// seq is the deferred record's defer.seq (a re-deferral keeps its
	// place); 0 for a new message, which lands behind everything.
	seq int64
	// partition and offset are where the key's latest deferral went in
	// the defer topic: an answer whose Stored passes offset covers it.
	partition int32
	offset    int64
}

// New checks cfg and returns a Gate that produces through p. It does not
// use p yet: an adapter may check its configuration with New before it
// connects p to Kafka.
func New(cfg Config, p Producer) (*Gate, error) {
	if cfg.Source != "" && !protocol.ValidSource(cfg.Source) {
		return nil, fmt.Errorf("deferclient: source %q is not 1 to %d of [A-Za-z0-9._-]", cfg.Source, protocol.MaxSourceBytes)
	}
	if len(cfg.SourceKey) > 0 && len(cfg.SourceKey) < protocol.MinKeyBytes {
		return nil, fmt.Errorf("deferclient: source key of %d bytes, need at least %d", len(cfg.SourceKey), protocol.MinKeyBytes)
	}
	if len(cfg.SourceKey) > 0 && cfg.Source == "" {
		return nil, errors.New("deferclient: a source key needs a source name")
	}
	if len(cfg.Group) > protocol.MaxGroupBytes {
		return nil, fmt.Errorf("deferclient: group of %d bytes, at most %d", len(cfg.Group), protocol.MaxGroupBytes)
	}
	if p == nil {
		return nil, errors.New("deferclient: no producer")
	}
	if cfg.DeferTopic == "" {
		cfg.DeferTopic = DefaultDeferTopic
	}
	if cfg.KeyStateWait <= 0 {
		cfg.KeyStateWait = 2 * time.Second
	}
	hc := cfg.HTTPClient
	if hc == nil {
		hc = &http.Client{Timeout: cfg.KeyStateWait + 5*time.Second}
	}
	var urls []string
	for _, u := range strings.Split(cfg.SchedulerURL, ",") {
		if u = strings.TrimRight(strings.TrimSpace(u), "/"); u != "" {
			urls = append(urls, u)
		}
	}
	return &Gate{cfg: cfg, p: p, urls: urls, http: hc, pending: map[string]localDeferral{}}, nil
}

// Config returns the Gate's configuration, with defaults filled in.
func (g *Gate) Config() Config { return g.cfg }

// Stats counts what a client did since it was created.
type Stats struct {
	// Handled counts records the wrapped handler handled successfully.
	Handled int64
	// Deferred counts records deferred after a failure (Defer, or the
	// handler's error); Gated those deferred behind a blocked key.
	Deferred, Gated int64
	// Queries counts key-state queries answered; QueryFailures those that
	// failed or came back unsure, whose keys then counted as blocked.
	Queries, QueryFailures int64
	// SetLoads counts loads of the group's blocked-key set (at each
	// assignment, and when the scheduler says to load again); FeedPolls
	// the answers of its feed, FeedFailures loads and polls that failed.
	SetLoads, FeedPolls, FeedFailures int64
	// BlockedKeys is how many keys the set holds blocked now.
	BlockedKeys int
}

// Stats returns the Gate's counts so far.
func (g *Gate) Stats() Stats {
	g.set.mu.Lock()
	blocked := len(g.set.keys)
	g.set.mu.Unlock()
	g.statsMu.Lock()
	defer g.statsMu.Unlock()
	st := g.stats
	st.BlockedKeys = blocked
	return st
}

func (g *Gate) count(f func(*Stats)) {
	g.statsMu.Lock()
	defer g.statsMu.Unlock()
	f(&g.stats)
}
