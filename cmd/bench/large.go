package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/IBM/sarama"
)

// topicLarge is the large-message scenario's target.
const topicLarge = "bench.large"

// largeSize is the large-message scenario's value size: near Kafka's 1 MB
// default limit (the records' headers and batch framing come on top).
const largeSize = 950_000

// largeResult is what the large-message scenario measured.
type largeResult struct {
	n        int   // records in the backlog, half of them due at once
	bytes    int64 // their values' bytes
	ingest   rate  // the whole backlog stored, from the service's start
	dispatch rate  // the due half on its target, from the service's start
	hwm, rss int64 // the service's peak and final resident set
}

// runLarge runs the service on a backlog of records near the 1 MB limit
// waiting in the defer topic when it starts, half due at once and half in an
// hour: memory must be bounded by bytes, not by record counts (issue 15 saw
// 1.8 GB of RSS for 400 such records with count-bounded buffers). It reports
// the process's peak RSS beside the small-message scenarios'.
func (b *bench) runLarge(ctx context.Context) (res largeResult, err error) {
	res.n = b.cfg.Large
	db, err := b.pg.freshService(ctx, "svc_large")
	if err != nil {
		return res, err
	}
	defer func() { err = errors.Join(err, b.pg.drop(context.WithoutCancel(ctx), db)) }()
	kc, addr, err := startKafka(b.cfg.Partitions, deferTopic, topicLarge)
	if err != nil {
		return res, err
	}
	defer kc.Close()
	lp, w, err := newClients(addr)
	if err != nil {
		return res, err
	}
	defer lp.close()
	defer w.close()

	later := time.Now().Add(time.Hour)
	pad := bytes.Repeat([]byte("L"), largeSize-len(payload(0)))
	if _, _, err := produceAll(ctx, lp, res.n, func(i int) *sarama.ProducerMessage {
		wh := when{}
		if i%2 == 1 {
			wh = when{at: later}
		}
		m := deferRecord(ownKeys.key("L", i), i, topicLarge, wh)
		m.Value = sarama.ByteEncoder(append(payload(i), pad...))
		return m
	}); err != nil {
		return res, err
	}
	res.bytes = int64(res.n) * largeSize

	b.say("  starting the scheduler (%d records of %d bytes waiting in %s)", res.n, largeSize, deferTopic)
	cpu0 := b.cpu(0)
	start := time.Now()
	svc, err := b.startService(ctx, db.url, addr, false)
	if err != nil {
		return res, err
	}
	defer svc.Kill()
	pid := svc.Pid()
	stored := func() (int64, error) {
		var s int64
		err := db.pool.QueryRow(ctx, "SELECT coalesce(sum(next_offset), 0) FROM ingest_offset WHERE topic = $1", deferTopic).Scan(&s)
		return s, err
	}
	due := int64((res.n + 1) / 2)
	pr, err := track(ctx, "large records delivered", func() (int64, error) { return w.count(topicLarge) }, 0, due, timeoutFor(res.n*100))
	if err != nil {
		return res, fmt.Errorf("%w; scheduler's last output:\n%s", err, svc.Logs())
	}
	res.dispatch = rate{n: due, wall: pr.doneAt.Sub(start), cpu: b.cpu(pid).sub(cpu0)}
	pr, err = track(ctx, "large records stored", stored, 0, int64(res.n), timeoutFor(res.n*100))
	if err != nil {
		return res, fmt.Errorf("%w; scheduler's last output:\n%s", err, svc.Logs())
	}
	res.ingest = rate{n: int64(res.n), wall: max(pr.doneAt.Sub(start), time.Millisecond), cpu: b.cpu(pid).sub(cpu0)}
	if res.hwm, res.rss, err = svc.Memory(); err != nil {
		return res, err
	}
	if err := svc.Stop(time.Minute); err != nil {
		return res, err
	}
	ds, err := readBack(ctx, addr, topicLarge)
	if err != nil {
		return res, err
	}
	// The due half are the even indexes below n.
	c := verify(ds, res.n)
	c.expected = int(due)
	if err := c.err("scheduler, large records"); err != nil {
		return res, err
	}
	for _, d := range ds {
		if d.index%2 == 1 {
			return res, fmt.Errorf("scheduler, large records: record %d, due in an hour, was delivered", d.index)
		}
	}
	return res, nil
}
