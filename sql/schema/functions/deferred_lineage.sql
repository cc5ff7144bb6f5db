-- deferred_lineage(message_id): the lineage of a message, the id that its
-- history rows carry as lineage_id and deferred_lineage_history takes. A
-- lineage is a message and every re-deferral of it (records carrying
-- defer.id of an earlier row); its id is the id of the first message.
--
-- The message's first history row names it. A message with none yet
-- (stored pending and left alone since, migration 0012) is in its
-- origin's lineage, as the history triggers will record it: the lineage
-- of the origin's first history row, else the origin itself (its history
-- pruned), else the message itself (a first deferral). An id with neither
-- history nor row is its own lineage. Each step is one index probe.

CREATE OR REPLACE FUNCTION deferred_lineage(message_id bigint) RETURNS bigint
LANGUAGE sql STABLE AS $$
    SELECT coalesce(
        (SELECT a.lineage_id FROM deferred_attempt a
         WHERE a.message_id = deferred_lineage.message_id ORDER BY a.message_id, a.id LIMIT 1),
        (SELECT coalesce((SELECT a.lineage_id FROM deferred_attempt a
                          WHERE a.message_id = m.origin_id ORDER BY a.message_id, a.id LIMIT 1),
                         m.origin_id, m.id)
         FROM deferred_message m WHERE m.id = deferred_lineage.message_id),
        deferred_lineage.message_id)
$$;
