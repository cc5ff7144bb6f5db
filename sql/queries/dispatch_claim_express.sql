-- The express claim: up to $1 due heads of the light targets $6 (from
-- dispatch_express_targets.sql), at most $7 of each, leased to $4 until
-- now() + $2, each with its consecutive due pending messages in order (at
-- most $3 per key), within $5 bytes in all; earliest due first over all of
-- them.
--
-- Why (docs/design.md 4.4, "Express claims"): while a target drains a
-- backlog, every main claim reads a whole round, and the loops of a process
-- take it in turn; a message due on arrival at another target waits for
-- the claim that is running when it is stored and for the next one. This
-- statement is run when a notification says a head became due, every loop
-- is busy and some target has a backlog (internal/dispatch's RunExpress),
-- outside the turns, and reads at most $7 heads per target.
--
-- The heads are read and locked as the main claim reads them (SKIP LOCKED,
-- due-time order, from deferred_key_target_due, without paused and
-- rate-limited targets, whose heads are not in it; the target_control
-- check is the main claim's safety net, see there). A target that grew a
-- backlog since it was counted gives at most $7 heads.
--
-- From "claimed AS" on, this is dispatch_claim.sql word for word (per-key
-- order, the byte budget and the release of keys that come back empty rest
-- on it; TestClaimStatementsShareTheirMessageRead checks it).
WITH due AS MATERIALIZED (
    SELECT h.ctid
    FROM unnest($6::text[]) AS t(target)
    CROSS JOIN LATERAL (
        SELECT k.ctid, k.next_run_at
        FROM deferred_key k
        WHERE NOT k.throttled
          AND k.head_target = t.target
          AND k.next_run_at <= now()
          AND (k.leased_until IS NULL OR k.leased_until <= now())
        ORDER BY k.next_run_at
        LIMIT $7
        FOR UPDATE SKIP LOCKED
    ) h
    WHERE coalesce(t.target <> ALL (ARRAY(SELECT c.target_topic FROM target_control c
                                          WHERE c.paused OR c.rate_limit IS NOT NULL)), false)
    ORDER BY h.next_run_at
    LIMIT $1
), claimed AS (
    -- The heads by their ctids, which a TID scan reads directly, whatever
    -- the size of deferred_key. Written as a join (FROM due WHERE k.ctid =
    -- due.ctid), it was planned as a hash join over a sequential scan of
    -- every head, up to about 65,000 keys: a third of a claim's time at
    -- 20,000 (docs/benchmarks.md, "Three plans fixed"). A version
    -- newer than this statement's snapshot is not visible to the TID scan
    -- either, so a head that changed since is skipped, as by the join.
    UPDATE deferred_key k
    SET leased_until = now() + $2::interval, leased_by = $4::text
    WHERE k.ctid = ANY (ARRAY(SELECT ctid FROM due))
    RETURNING k.business_key, k.head_id, k.head_seq
), run AS (
    SELECT c.business_key, c.head_id, m.id, m.seq, m.target_topic, m.next_run_at, m.attempt, m.redrive_count,
           m.key, m.value, m.header_keys, m.header_values, m.group_id, m.nth,
           -- The bytes of the rows before this one, in the output order.
           coalesce(sum(coalesce(octet_length(m.key), 0) + coalesce(octet_length(m.value), 0)
                        + coalesce((SELECT sum(octet_length(h)) FROM unnest(m.header_values) AS h)::int, 0))
                    OVER (ORDER BY c.business_key, c.head_id, m.seq, m.id
                          ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS bytes_before
    FROM claimed c
    LEFT JOIN LATERAL (
        SELECT s.id, s.seq, s.target_topic, s.next_run_at, s.attempt, s.redrive_count, s.key, s.value,
               s.header_keys, s.header_values, s.group_id, s.nth
        FROM (
            SELECT m.*, bool_and(m.state = 'pending' AND m.next_run_at <= now()) OVER w AS all_due,
                   row_number() OVER w AS nth
            FROM deferred_message m
            WHERE c.business_key IS NOT NULL AND m.business_key = c.business_key
              -- The head candidates (deferred_message_key_order's predicate),
              -- so that a parked message holding the key ends the run.
              AND (m.state = 'pending' OR (m.state = 'parked' AND m.park_holds_key))
              -- Never hand out anything before the head the claim leased. The
              -- ctid match above already skips a head that changed after this
              -- statement's snapshot; this keeps the read right even if that
              -- match changes.
              AND (m.seq, m.id) >= (c.head_seq, c.head_id)
            WINDOW w AS (ORDER BY m.seq, m.id)
            ORDER BY m.seq, m.id
            LIMIT $3
        ) s
        WHERE s.all_due
        UNION ALL
        SELECT m.id, m.seq, m.target_topic, m.next_run_at, m.attempt, m.redrive_count, m.key, m.value,
               m.header_keys, m.header_values, m.group_id, 1
        FROM deferred_message m
        -- IS TRUE: by the primary key, never by a walk of the partial
        -- deferred_message_key_order (see dispatch_delete.sql).
        WHERE c.business_key IS NULL AND m.id = c.head_id AND (m.state = 'pending') IS TRUE AND m.next_run_at <= now()
    ) m ON true
)
-- Past the budget, a key's first row stays, emptied, so that the key comes
-- back (nth is NULL on the row of a key with no message at all).
--
-- target_weight is the weight of each message's target (target_control;
-- 1 without a row), from which internal/keylock's nextShare sizes what the
-- next main claim reads of each target.
--
-- claimed_at is this statement's now(), the database's clock at the claim:
-- the finalize records each delivery's 'published' event at it, not at its
-- own now(). A consumer can read the record, re-defer it and ingest store
-- the re-deferral before the finalize starts; recorded at the finalize,
-- the delivery came after the deferral it caused in the history. Every
-- consequence of the publish starts after this claim committed, on the same
-- clock (docs/design.md section 3.5).
SELECT r.business_key, r.head_id, now() AS claimed_at,
       CASE WHEN r.bytes_before < $5::bigint THEN r.id END AS id,
       CASE WHEN r.bytes_before < $5::bigint THEN r.seq END AS seq,
       CASE WHEN r.bytes_before < $5::bigint THEN r.target_topic END AS target_topic,
       CASE WHEN r.bytes_before < $5::bigint THEN r.next_run_at END AS next_run_at,
       CASE WHEN r.bytes_before < $5::bigint THEN r.attempt END AS attempt,
       CASE WHEN r.bytes_before < $5::bigint THEN r.redrive_count END AS redrive_count,
       CASE WHEN r.bytes_before < $5::bigint THEN r.key END AS key,
       CASE WHEN r.bytes_before < $5::bigint THEN r.value END AS value,
       CASE WHEN r.bytes_before < $5::bigint THEN r.header_keys END AS header_keys,
       CASE WHEN r.bytes_before < $5::bigint THEN r.header_values END AS header_values,
       CASE WHEN r.bytes_before < $5::bigint THEN r.group_id END AS group_id,
       coalesce(w.weight, 1) AS target_weight
FROM run r
LEFT JOIN target_control w ON w.target_topic = r.target_topic
WHERE r.bytes_before < $5::bigint OR coalesce(r.nth, 1) = 1
ORDER BY r.business_key, r.head_id, r.seq, r.id
